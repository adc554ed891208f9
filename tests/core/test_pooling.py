"""Pooling requests in the engine core (core/pooling.py): each input runs whole in one step, never chunked,
ends with its step's vector, frees its blocks then, and keeps the generation path's priority, abort and
deadline rules. A fake executor "pools" each sequence into (length, first id, position of its first token)."""

from __future__ import annotations

from asyncllm.core.engine_core import EngineCore
from asyncllm.core.request import Request
from asyncllm.pooling import PoolingParams
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import ModelRunnerOutput, ReadyStep, SchedulerOutput, StepResult
from tests.fixtures.fake_executor import make_runtime


class PoolingExecutor:
    def __init__(self, num_kv_blocks: int = 64) -> None:
        self.runtime = make_runtime(num_kv_blocks=num_kv_blocks, block_size=4)
        self.steps: list[SchedulerOutput] = []

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        self.steps.append(scheduled)
        pooled = [[float(s.num_tokens), float(s.input_token_ids[0]), float(s.start_pos)] for s in scheduled.seqs]
        return ReadyStep(ModelRunnerOutput([], pooled=pooled))

    def shutdown(self) -> None:
        pass

    def watch_failure(self, callback: object) -> None:
        pass


def _core(executor: PoolingExecutor, budget: int, now: list[float] | None = None) -> EngineCore:
    clock = [0.0] if now is None else now
    return EngineCore(
        executor,  # type: ignore[arg-type]
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        seed=0,
        tokenizer=None,
        clock=lambda: clock[0],
    )


def _request(rid: str, n: int, first: int = 1, priority: int = 0, deadline: float | None = None) -> Request:
    ids = [first] + [2] * (n - 1)
    return Request(
        rid, ids, SamplingParams(max_tokens=1), 0.0, 1, priority=priority, deadline=deadline, pooling=PoolingParams()
    )


def _run(core: EngineCore) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    while core.has_unfinished():
        for d in core.step():
            assert d.finish_reason == "stop" and d.pooled is not None, d
            out[d.request_id] = d.pooled
    return out


def test_inputs_run_whole_in_one_step_and_free_their_blocks() -> None:
    executor = PoolingExecutor()
    core = _core(executor, budget=10)
    for rid, n in [("a", 6), ("b", 6), ("c", 3), ("d", 10)]:
        core.add_request(_request(rid, n))
    out = _run(core)
    assert out == {"a": [6, 1, 0], "b": [6, 1, 0], "c": [3, 1, 0], "d": [10, 1, 0]}  # whole, from position 0
    # "b" did not fit beside "a" (6 + 6 > 10): it waited instead of being chunked; "c" could not pass it
    assert [[s.request_id for s in step.seqs] for step in executor.steps] == [["a"], ["b", "c"], ["d"]]
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def test_priority_picks_who_runs_first_and_an_abort_frees_a_waiting_input() -> None:
    executor = PoolingExecutor()
    core = _core(executor, budget=8)
    core.add_request(_request("late", 8, first=3, priority=5))
    core.add_request(_request("urgent", 8, first=4, priority=-1))
    core.add_request(_request("dropped", 4))
    assert [d.finish_reason for d in core.abort("dropped")] == ["abort"]
    out = _run(core)
    assert list(out) == ["urgent", "late"]
    assert core.stats().num_free_blocks == core.stats().num_total_blocks


def test_a_deadline_passed_before_its_step_ends_the_input_with_a_timeout() -> None:
    executor = PoolingExecutor()
    now = [0.0]
    core = _core(executor, budget=8, now=now)
    core.add_request(_request("slow", 4, deadline=1.0))
    now[0] = 2.0
    (delta,) = core.step()
    assert delta.finish_reason == "timeout" and delta.error is not None and delta.pooled is None
    assert not executor.steps and not core.has_unfinished()
