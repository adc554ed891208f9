"""Per-request deadlines in the engine core (`Request.deadline`, set from `add_request(..., timeout=)`): a
request not finished by its deadline ends at the next step, waiting or running, its blocks freed, with
finish_reason "timeout" once it has output and `RequestTimeoutError` before; the others run on unchanged."""

from __future__ import annotations

import random

from asyncllm.core.output_processor import RequestDelta
from asyncllm.core.request import RequestStatus
from asyncllm.errors import RequestTimeoutError
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from tests.fixtures.fake_executor import FakeExecutor, make_engine_core, make_runtime, reference_tokens


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(n)]


def _setup(num_kv_blocks: int = 64, **core_kwargs: object):  # type: ignore[no-untyped-def]
    runtime = make_runtime(num_kv_blocks=num_kv_blocks)
    executor = FakeExecutor(runtime)
    clock = ManualClock()
    core = make_engine_core(executor, clock=clock, **core_kwargs)  # type: ignore[arg-type]
    return core, InputProcessor(runtime, None), clock, executor


def _steps(core, n: int, out: dict[str, list[RequestDelta]]) -> None:  # type: ignore[no-untyped-def]
    for _ in range(n):
        for delta in core.step():
            out.setdefault(delta.request_id, []).append(delta)


def _tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def test_a_running_request_past_its_deadline_ends_with_timeout_and_frees_its_blocks() -> None:
    core, ip, clock, executor = _setup()
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    core.add_request(ip.make_request("late", _prompt(1, 9), params, 0.0, deadline=5.0))
    core.add_request(ip.make_request("free", _prompt(2, 9), params, 0.0))
    out: dict[str, list[RequestDelta]] = {}
    _steps(core, 6, out)
    had = len(_tokens(out["late"]))
    assert had > 0 and out["late"][-1].finish_reason is None
    clock.now = 5.0
    _steps(core, 1, out)
    last = out["late"][-1]
    assert last.finish_reason == "timeout" and last.error is None and last.metrics is not None
    assert len(_tokens(out["late"])) <= had + 1  # at most the token of the step in flight when it expired
    while core.has_unfinished():
        _steps(core, 1, out)
    assert _tokens(out["free"]) == reference_tokens(executor.next_token, _prompt(2, 9), 50, frozenset())
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_waiting_request_past_its_deadline_fails_with_request_timeout_error() -> None:
    # Room for one sequence: the second waits behind the first, and its deadline passes while it waits.
    core, ip, clock, _ = _setup(num_kv_blocks=16, max_num_seqs=1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    core.add_request(ip.make_request("first", _prompt(1, 9), params, 0.0))
    core.add_request(ip.make_request("second", _prompt(2, 9), params, 0.0, deadline=1.0))
    out: dict[str, list[RequestDelta]] = {}
    _steps(core, 3, out)
    assert "second" not in out and core.stats().num_waiting == 1
    clock.now = 1.0
    _steps(core, 1, out)
    (ended,) = out["second"]
    assert ended.finish_reason == "timeout" and isinstance(ended.error, RequestTimeoutError)
    assert "second" in str(ended.error) and ended.new_token_ids == []
    assert core.stats().num_waiting == 0
    while core.has_unfinished():
        _steps(core, 1, out)
    assert len(_tokens(out["first"])) == 30 and out["first"][-1].finish_reason == "length"
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_preempted_request_past_its_deadline_ends_with_timeout() -> None:
    """Preempted after some output (its KV dropped, waiting to be recomputed): it has output, so "timeout"."""
    core, ip, clock, _ = _setup(num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(3):
        core.add_request(ip.make_request(f"r{i}", _prompt(i, 7), params, 0.0, deadline=50.0 if i == 2 else None))
    out: dict[str, list[RequestDelta]] = {}
    for _ in range(200):
        _steps(core, 1, out)
        preempted = [r for r in core.scheduler.requests.values() if r.status is RequestStatus.PREEMPTED]
        if [r.request_id for r in preempted] == ["r2"] and _tokens(out.get("r2", [])):
            break
    else:
        raise AssertionError("r2 was never preempted after some output")
    clock.now = 50.0
    while core.has_unfinished():
        _steps(core, 1, out)
    reasons = {rid: deltas[-1].finish_reason for rid, deltas in out.items()}
    assert reasons == {"r0": "length", "r1": "length", "r2": "timeout"}
    assert all(d.error is None for d in out["r2"])
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_samples_of_one_request_end_together_and_fail_only_without_any_output() -> None:
    core, ip, clock, _ = _setup()
    out: dict[str, list[RequestDelta]] = {}
    core.add_request(ip.make_request("g", _prompt(3, 6), SamplingParams(n=3, max_tokens=40, seed=1), 0.0, deadline=2.0))
    _steps(core, 4, out)
    clock.now = 2.0
    _steps(core, 1, out)
    finals = [d for d in out["g"] if d.finish_reason is not None]
    assert sorted(d.index for d in finals) == [0, 1, 2]
    assert {d.finish_reason for d in finals} == {"timeout"} and all(d.error is None for d in finals)
    assert not core.has_unfinished()

    core.add_request(ip.make_request("h", _prompt(4, 6), SamplingParams(n=2, max_tokens=4), 2.0, deadline=2.0))
    out.clear()
    _steps(core, 1, out)  # due before its first step: no sample has output
    assert all(isinstance(d.error, RequestTimeoutError) for d in out["h"]) and len(out["h"]) == 2


def test_a_request_finished_before_its_deadline_is_untouched() -> None:
    core, ip, clock, _ = _setup()
    core.add_request(ip.make_request("quick", _prompt(5, 4), SamplingParams(max_tokens=3), 0.0, deadline=1.0))
    out: dict[str, list[RequestDelta]] = {}
    while core.has_unfinished():
        _steps(core, 1, out)
    assert out["quick"][-1].finish_reason in ("length", "stop")
    clock.now = 10.0
    assert core.step() == []
