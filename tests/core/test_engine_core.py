"""EngineCore over a FakeExecutor: deltas, metrics, stop strings through the step, aborts, failures."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from asyncllm.core.detokenizer import backend_tokenizer
from asyncllm.core.output_processor import RequestDelta
from asyncllm.core.request import Request
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import ReadyStep
from tests.fixtures.fake_executor import (
    FakeExecutor,
    InjectedFailure,
    make_engine_core,
    make_runtime,
    reference_tokens,
)
from tests.fixtures.tiny_models import build_tokenizer


def _setup(**runtime_kwargs):
    runtime = make_runtime(**runtime_kwargs)
    executor = FakeExecutor(runtime)
    return executor, InputProcessor(runtime, None)


def _run(core, max_steps: int = 500) -> dict[str, list[RequestDelta]]:
    deltas: dict[str, list[RequestDelta]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            return deltas
        for delta in core.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    raise AssertionError("requests did not finish")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 64) for _ in range(n)]


def test_generates_reference_tokens_with_metrics() -> None:
    executor, ip = _setup()
    core = make_engine_core(executor, max_num_batched_tokens=16)
    requests: list[Request] = []
    for i in range(4):
        request = ip.make_request(f"r{i}", _prompt(i, 5 + 7 * i), SamplingParams(max_tokens=6 + i), 0.0)
        core.add_request(request)
        requests.append(request)
    assert core.stats().num_waiting == 4
    deltas = _run(core)
    for request in requests:
        out = deltas[request.request_id]
        tokens = [t for d in out for t in d.new_token_ids]
        assert tokens == reference_tokens(
            executor.next_token, request.prompt_token_ids, request.max_tokens, frozenset()
        )
        assert all(d.finish_reason is None and d.metrics is None for d in out[:-1])
        final = out[-1]
        assert final.finish_reason == "length" and final.metrics is not None
        m = final.metrics
        assert m.num_prompt_tokens == request.num_prompt_tokens and m.num_generated_tokens == len(tokens)
        assert 0 < m.time_to_first_token < m.e2e_latency
        assert request.is_finished and request.finish_time is not None
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks == 64
    assert set(stats.as_dict()) >= {"num_running", "num_waiting", "num_free_blocks", "prefix_cache_hit_rate"}


def test_empty_step_does_nothing() -> None:
    executor, _ = _setup()
    core = make_engine_core(executor)
    assert core.step() == [] and executor.num_steps == 0
    assert (core.last_step.num_prefill_tokens, core.last_step.num_decode_tokens) == (0, 0)


def test_seeds_are_per_request() -> None:
    executor, ip = _setup()
    core = make_engine_core(executor, seed=123)
    core.add_request(ip.make_request("fixed", [1, 2], SamplingParams(seed=7, max_tokens=1), 0.0))
    core.add_request(ip.make_request("drawn1", [1, 2], SamplingParams(max_tokens=1), 0.0))
    core.add_request(ip.make_request("drawn2", [1, 2], SamplingParams(max_tokens=1), 0.0))
    core.step()
    seeds = {n.request_id: n.seed for n in executor.steps[0].new_requests}
    assert seeds["fixed"] == 7 and seeds["drawn1"] != seeds["drawn2"]
    executor2, _ = _setup()
    core2 = make_engine_core(executor2, seed=123)
    core2.add_request(ip.make_request("drawn1", [1, 2], SamplingParams(max_tokens=1), 0.0))
    core2.step()
    assert executor2.steps[0].new_requests[0].seed == seeds["drawn1"]  # the engine seed decides


def test_abort_returns_final_delta_and_frees_blocks() -> None:
    executor, ip = _setup()
    core = make_engine_core(executor)
    core.add_request(ip.make_request("a", _prompt(1, 9), SamplingParams(max_tokens=50), 0.0))
    core.add_request(ip.make_request("b", _prompt(2, 9), SamplingParams(max_tokens=3), 0.0))
    core.step()
    core.step()
    delta = core.abort_request("a")
    assert delta is not None and delta.finish_reason == "abort" and delta.metrics is not None
    assert delta.metrics.num_generated_tokens == 2
    assert core.abort_request("a") is None and core.abort_request("zzz") is None
    deltas = _run(core)
    assert "a" not in deltas and deltas["b"][-1].finish_reason == "length"
    assert core.abort_request("b") is None  # finished already
    assert core.stats().num_free_blocks == 64


def test_executor_failure_propagates() -> None:
    runtime = make_runtime()
    executor = FakeExecutor(runtime, fail_after_steps=2)
    core = make_engine_core(executor)
    core.add_request(InputProcessor(runtime, None).make_request("a", [1, 2, 3], SamplingParams(max_tokens=9), 0.0))
    core.step()
    core.step()
    with pytest.raises(InjectedFailure, match="step 3"):
        core.step()
    core.shutdown()
    assert executor.is_shut_down


def test_shared_prefix_hits_through_the_engine() -> None:
    executor, ip = _setup(block_size=4)
    core = make_engine_core(executor)
    shared = _prompt(3, 12)
    core.add_request(ip.make_request("a", [*shared, 1], SamplingParams(max_tokens=4), 0.0))
    _run(core)
    core.add_request(ip.make_request("b", [*shared, 2], SamplingParams(max_tokens=4), 0.0))
    deltas = _run(core)
    assert deltas["b"][-1].metrics.num_cached_tokens == 12
    assert core.stats().prefix_cache_hit_rate == pytest.approx(12 / 26)


def _scripted(prompt_len: int, script: list[int]):
    def next_token(tokens: Sequence[int]) -> int:
        return script[len(tokens) - prompt_len]

    return next_token


def test_stop_string_finishes_in_the_step_with_text(tmp_path) -> None:
    tok = backend_tokenizer(build_tokenizer(tmp_path))
    prompt = tok.encode("The capital").ids
    script = tok.encode(" of France is Paris. Hello world! 日本語").ids
    runtime = make_runtime(vocab_size=tok.get_vocab_size(), eos_token_ids=frozenset({0}))
    executor = FakeExecutor(runtime, next_token=_scripted(len(prompt), script))
    core = make_engine_core(executor, tokenizer=tok)
    ip = InputProcessor(runtime, lambda s: tok.encode(s).ids)
    core.add_request(ip.make_request("a", "The capital", SamplingParams(stop=["Paris"]), 0.0))
    deltas = _run(core)["a"]
    assert "".join(d.new_text for d in deltas) == " of France is "
    assert deltas[-1].finish_reason == "stop"
    assert core.stats().num_free_blocks == core.stats().num_total_blocks
    # The same script without a stop: text chunks concatenate to the decoded ids, CJK included.
    executor = FakeExecutor(runtime, next_token=_scripted(len(prompt), script))
    core = make_engine_core(executor, tokenizer=tok)
    core.add_request(ip.make_request("b", "The capital", SamplingParams(max_tokens=len(script)), 0.0))
    deltas = _run(core)["b"]
    ids = [t for d in deltas for t in d.new_token_ids]
    assert ids == script and "".join(d.new_text for d in deltas) == tok.decode(script)


class _AbortMidStep:
    """Wraps an executor: at step `at`, aborts `victims` while the forward pass "runs"."""

    def __init__(self, inner: FakeExecutor, at: int, victims: list[str]) -> None:
        self.inner, self.at, self.victims = inner, at, victims
        self.core = None
        self.abort_deltas: list[RequestDelta | None] = []

    @property
    def runtime(self):
        return self.inner.runtime

    def submit(self, scheduled):
        out = self.inner.execute_model(scheduled)
        if self.inner.num_steps == self.at:
            self.abort_deltas = [self.core.abort_request(rid) for rid in self.victims]
        return ReadyStep(out)

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_abort_during_the_forward_pass() -> None:
    """The aborted request gets no token from the step it was aborted in, even one that would have finished
    it, and its blocks are freed exactly once; the others are unaffected."""
    runtime = make_runtime()
    inner = FakeExecutor(runtime)
    wrapper = _AbortMidStep(inner, at=3, victims=["a", "b"])
    core = make_engine_core(wrapper)  # type: ignore[arg-type]
    wrapper.core = core
    ip = InputProcessor(runtime, None)
    core.add_request(ip.make_request("a", _prompt(1, 6), SamplingParams(max_tokens=20), 0.0))
    core.add_request(ip.make_request("b", _prompt(2, 6), SamplingParams(max_tokens=3), 0.0))  # finishes at step 3
    core.add_request(ip.make_request("c", _prompt(3, 6), SamplingParams(max_tokens=5), 0.0))
    seen: dict[str, list[RequestDelta]] = {}
    while core.has_unfinished():
        for delta in core.step():
            seen.setdefault(delta.request_id, []).append(delta)
    assert [d.finish_reason for d in wrapper.abort_deltas] == ["abort", "abort"]
    assert [len(seen[rid]) for rid in "ab"] == [2, 2]  # steps 1 and 2 only
    assert all(d.finish_reason is None for rid in "ab" for d in seen[rid])
    tokens = [t for d in seen["c"] for t in d.new_token_ids]
    assert tokens == reference_tokens(inner.next_token, _prompt(3, 6), 5, frozenset())
    assert core.stats().num_free_blocks == 64
    assert set(inner.steps[3].finished_request_ids) == {"a", "b"}  # the runner hears of it the next step


def test_interrupted_step_leaves_no_stale_prefix() -> None:
    """Regression: a step interrupted before its forward pass (Ctrl-C) left prefix hashes pointing at blocks
    whose KV was never written; the same prompt then hit the cache and came out wrong, silently. The fake
    executor samples from the token ids its "cache" holds, so stale KV changes the tokens (or trips its check
    on never-written slots)."""

    class InterruptOnce(FakeExecutor):
        interrupt = True

        def submit(self, scheduled):  # type: ignore[no-untyped-def]
            if self.interrupt:
                self.interrupt = False
                raise KeyboardInterrupt
            return super().submit(scheduled)

    executor = InterruptOnce(make_runtime(block_size=4, num_kv_blocks=64))
    ip = InputProcessor(executor.runtime, None)
    core = make_engine_core(executor)
    prompt = list(range(5, 41))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    core.add_request(ip.make_request("first", prompt, params, 0.0))
    with pytest.raises(KeyboardInterrupt):
        core.step()
    core.abort_request("first")  # what LLM.generate does on the way out
    core.add_request(ip.make_request("again", prompt, params, 0.0))
    tokens = [t for d in _run(core)["again"] for t in d.new_token_ids]
    assert tokens == reference_tokens(executor.next_token, prompt, 6, frozenset())
    assert core.stats().num_free_blocks == core.stats().num_total_blocks
