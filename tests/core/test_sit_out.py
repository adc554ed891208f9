"""Draws that sit out (`ModelRunnerOutput.deferred`: a constrained request whose next mask the slow lane has
not filled yet, structured_output/deferral.py). The executor draws no token for such a row; the core must
give that request no token, have its next step compute its last known token again, plan it no more while a
step of it is in flight, and drop the draw of a step planned before it knew (overlapped scheduling), which
followed a token that never came. The fake executor samples by reading the whole sequence back from its
"KV", and a deferred row leaves a garbage token as the request's latest (as the device does): any position
computed from it, or any token of it output, changes the tokens. So every request must still produce
exactly what an unbatched run produces, serial or overlapped, with every block freed once."""

from __future__ import annotations

import pytest

from asyncllm.core.output_processor import RequestDelta
from asyncllm.core.request import Request
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import ModelRunnerOutput, SchedulerOutput
from tests.core.invariants import check_block_invariants
from tests.fixtures.fake_executor import FakeExecutor, make_engine_core, make_runtime, reference_tokens

EOS = 0
GARBAGE = 63  # what a deferred row draws (any token: it is never output)


class DeferringExecutor(FakeExecutor):
    """Defers the draws of requests in `slow` as the runner would: a row whose input is the token of a
    deferred draw (a placeholder after one), and otherwise `pattern[n % len(pattern)]` for its n-th fresh
    attempt (True: not ready, sit out)."""

    def __init__(self, *args: object, slow: set[str], pattern: tuple[bool, ...], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.slow, self.pattern = slow, pattern
        self._voided: set[str] = set()  # requests whose last draw sat out
        self._attempts: dict[str, int] = {}
        self.deferred_rows = 0
        self.first_deferral: dict[str, int] = {}  # request -> the index in `steps` of its first deferred draw

    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        output = super().execute_model(scheduled)
        sampled, deferred = list(output.sampled_token_ids), []
        rows = [seq for seq in scheduled.seqs if seq.sample]
        for index, seq in enumerate(rows):
            rid = seq.request_id
            if rid not in self.slow:
                continue
            if rid in self._voided and seq.takes_previous_token:
                sits = True  # its logits follow a token that never came
            else:
                n = self._attempts.get(rid, 0)
                self._attempts[rid] = n + 1
                sits = self.pattern[n % len(self.pattern)]
            if sits:
                deferred.append(index)
                sampled[index] = GARBAGE
                self._last_sampled[rid] = GARBAGE  # the device records the draw all the same
                self._voided.add(rid)
                self.first_deferral.setdefault(rid, len(self.steps) - 1)
            else:
                self._voided.discard(rid)
        self.deferred_rows += len(deferred)
        return ModelRunnerOutput(sampled, deferred=deferred or None)


def _run(core, executor: DeferringExecutor) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    out: dict[str, list[int]] = {}
    ended: set[str] = set()

    def take(delta: RequestDelta) -> None:
        assert delta.request_id not in ended, f"{delta.request_id} streamed after it ended"
        out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        if delta.finish_reason is not None:
            ended.add(delta.request_id)

    for _ in range(3000):
        if not core.has_unfinished():
            break
        for delta in core.step():
            take(delta)
        check_block_invariants(core.block_manager, core.scheduler.requests.values())
    assert not core.has_unfinished()
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return out


PROMPTS = {f"r{i}": [5 + i, 6, 7, 8 + i, 9][: 3 + i % 3] for i in range(6)}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pattern", [(True, False), (True, True, False), (False, True, True, True, False)])
def test_requests_whose_draws_sit_out_give_the_unbatched_tokens(overlap: bool, pattern: tuple[bool, ...]) -> None:
    runtime = make_runtime(vocab_size=64, num_kv_blocks=64, block_size=4, eos_token_ids=frozenset({EOS}))
    slow = {"r0", "r3", "r4"}
    executor = DeferringExecutor(runtime, asynchronous=overlap, slow=slow, pattern=pattern)
    core = make_engine_core(executor, max_num_seqs=4, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        core.add_request(Request(rid, prompt, params, 0.0, max_tokens=12))
    got = _run(core, executor)
    for rid, prompt in PROMPTS.items():
        assert got[rid] == reference_tokens(executor.next_token, prompt, 12, frozenset()), rid
    assert executor.deferred_rows > 0
    # Once the core has read a request's first deferred draw (step n, read while step n + 1 runs), no later
    # step of it follows a draw in flight.
    for rid, n in executor.first_deferral.items():
        for step in executor.steps[n + 2 :]:
            assert not any(s.takes_previous_token for s in step.seqs if s.request_id == rid), (rid, n)
    if overlap:
        assert any(s.takes_previous_token for step in executor.steps for s in step.seqs if s.request_id not in slow)
