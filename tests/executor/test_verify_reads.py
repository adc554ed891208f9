"""A tensor-parallel worker's reads of its verifying steps (`VerifyReads`): each verifying step is read exactly
once, after the next step is submitted (the device stays busy), but before a step that names one of its
drafted requests (samples, finishes or preempts it); steps without drafts are never read."""

from __future__ import annotations

from asyncllm.executor.verify_reads import VerifyReads
from asyncllm.step import ModelRunnerOutput, ScheduledSeq, SchedulerOutput


class Recorded:
    """A `StepResult` recording when it is read into `log`."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def done(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def result(self) -> ModelRunnerOutput:
        self.log.append(f"read {self.name}")
        return ModelRunnerOutput([])


def _step(*seqs: tuple[str, int], finished: tuple[str, ...] = ()) -> SchedulerOutput:
    scheduled = [ScheduledSeq(rid, [1] * (1 + k), 0, [0], True, k) for rid, k in seqs]
    return SchedulerOutput(scheduled, finished_request_ids=list(finished), num_draft_tokens=sum(k for _, k in seqs))


def _drive(steps: list[SchedulerOutput]) -> list[str]:
    log: list[str] = []
    reads = VerifyReads()
    for i, step in enumerate(steps):
        reads.before_submit(step)
        log.append(f"submit {i}")
        reads.after_submit(step, Recorded(str(i), log))
    return log


def test_a_verifying_step_is_read_after_the_next_submit() -> None:
    log = _drive([_step(("a", 3), ("b", 0)), _step(("b", 0)), _step(("c", 0))])
    assert log == ["submit 0", "submit 1", "read 0", "submit 2"]


def test_a_step_naming_a_drafted_request_waits_for_the_read() -> None:
    """Its drafted request sampled again, or finished (an abort): the state is settled before the step."""
    for named in (_step(("a", 2)), _step(finished=("a",))):
        log = _drive([_step(("a", 3), ("b", 0)), named])
        assert log == ["submit 0", "read 0", "submit 1"]
    # A request of that step without drafts of its own does not wait.
    assert _drive([_step(("a", 3), ("b", 0)), _step(("b", 0))]) == ["submit 0", "submit 1", "read 0"]


def test_back_to_back_verifying_steps_are_each_read_once() -> None:
    log = _drive([_step(("a", 2)), _step(("b", 1)), _step(("c", 4)), _step(("d", 0))])
    assert log == ["submit 0", "submit 1", "read 0", "submit 2", "read 1", "submit 3", "read 2"]


def test_a_step_chained_on_a_drafted_request_is_submitted_before_the_read() -> None:
    """Chained on the step in flight (core/spec/chain.py): rank 0 launches it before reading that step, so a
    worker does too (the two stage the same draw counts), then reads the earlier step as after any submit."""
    chained = SchedulerOutput([ScheduledSeq("a", [-1, 5, 6], 4, [0], True, 2, chained=True)], num_draft_tokens=2)
    assert _drive([_step(("a", 3)), chained, _step(("b", 0))]) == [
        "submit 0",
        "submit 1",
        "read 0",
        "submit 2",
        "read 1",
    ]
