"""Scheduler (with BlockManager and a FakeExecutor under EngineCore): mixing, budgets, preemption, aborts.

The property test at the end drives random adds, aborts and steps with tiny memory and budgets and checks
the block invariants after every step and that every output equals an unbatched, unchunked run, with the
executor synchronous (serial scheduling) and asynchronous (overlapped: each step planned while the
previous one is in flight, its tokens fed in as placeholders).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncllm.core.engine_core import EngineCore
from asyncllm.core.output_processor import RequestDelta
from asyncllm.core.request import RequestStatus
from asyncllm.errors import InvalidRequestError
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from tests.core.invariants import check_block_invariants
from tests.fixtures.fake_executor import (
    FakeExecutor,
    hash_next_token,
    make_engine_core,
    make_runtime,
    reference_tokens,
)

EOS = frozenset({0})


class Harness:
    """An EngineCore over a FakeExecutor that collects every delta and checks invariants each step."""

    def __init__(
        self, *, num_blocks: int = 64, block_size: int = 4, next_token=None, overlap: bool = False, **limits
    ) -> None:
        self.runtime = make_runtime(num_kv_blocks=num_blocks, block_size=block_size, eos_token_ids=EOS)
        self.executor = FakeExecutor(self.runtime, next_token=next_token, asynchronous=overlap)
        self.core: EngineCore = make_engine_core(self.executor, **limits)
        self.inputs = InputProcessor(self.runtime, None)
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.requests: dict[str, object] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int | None = None) -> None:
        request = self.inputs.make_request(rid, prompt, SamplingParams(max_tokens=max_tokens), 0.0)
        self.core.add_request(request)
        self.requests[rid] = request
        self.tokens[rid] = []

    def _take(self, delta: RequestDelta) -> None:
        assert delta.request_id not in self.reasons, f"{delta.request_id} got output after it finished"
        self.tokens[delta.request_id].extend(delta.new_token_ids)
        if delta.finish_reason is not None:
            self.reasons[delta.request_id] = delta.finish_reason

    def step(self) -> list[RequestDelta]:
        deltas = self.core.step()
        for delta in deltas:
            self._take(delta)
        check_block_invariants(self.core.block_manager, self.core.scheduler.requests.values())
        return deltas

    def abort(self, rid: str) -> RequestDelta | None:
        delta = self.core.abort_request(rid)
        if delta is not None:
            self._take(delta)
        check_block_invariants(self.core.block_manager, self.core.scheduler.requests.values())
        return delta

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.core.has_unfinished():
                break
            self.step()
        assert not self.core.has_unfinished(), "requests did not finish in bounded steps"
        bm = self.core.block_manager
        assert bm.num_free_blocks == bm.num_blocks

    def expected(self, rid: str) -> list[int]:
        request = self.requests[rid]
        return reference_tokens(self.executor.next_token, request.prompt_token_ids, request.max_tokens, EOS)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 64) for _ in range(n)]


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    rng = random.Random(1)
    h = Harness(max_num_batched_tokens=8)
    h.add("a", _prompt(rng, 5), max_tokens=10)
    h.step()
    h.add("b", _prompt(rng, 20), max_tokens=3)
    h.step()
    seqs = {s.request_id: s for s in h.executor.steps[-1].seqs}
    assert seqs["a"].num_tokens == 1 and seqs["a"].start_pos == 5 and seqs["a"].sample
    assert seqs["b"].num_tokens == 7 and seqs["b"].start_pos == 0 and not seqs["b"].sample
    assert h.core.last_step.num_decode_tokens == 1 and h.core.last_step.num_prefill_tokens == 7
    h.run()
    assert h.tokens["a"] == h.expected("a") and h.tokens["b"] == h.expected("b")


def test_prompts_are_capped_while_requests_decode() -> None:
    rng = random.Random(3)
    h = Harness(max_num_batched_tokens=16, max_prefill_tokens_while_decoding=3)
    h.add("a", _prompt(rng, 13), max_tokens=12)
    h.step()  # nobody decodes yet: the prompt takes the whole budget
    assert h.executor.steps[-1].num_batched_tokens == 13
    h.add("b", _prompt(rng, 10), max_tokens=2)
    h.add("c", _prompt(rng, 4), max_tokens=2)
    prompt_len = {"a": 13, "b": 10, "c": 4}
    chunks: list[int] = []
    while "b" not in h.reasons or "c" not in h.reasons:
        h.step()
        seqs = {s.request_id: s for s in h.executor.steps[-1].seqs}
        assert "a" in seqs and seqs["a"].num_tokens == 1  # the decoding request advances every step
        prompt_tokens = sum(
            min(s.start_pos + s.num_tokens, prompt_len[rid]) - s.start_pos
            for rid, s in seqs.items()
            if s.start_pos < prompt_len[rid]
        )
        assert prompt_tokens <= 3
        chunks.append(seqs["b"].num_tokens if "b" in seqs else 0)
    assert chunks[:5] == [3, 3, 3, 1, 1]  # b's 10 prompt tokens, 3 per step, then its decode
    h.run()
    for rid in "abc":
        assert h.tokens[rid] == h.expected(rid)


def test_prompt_cap_leaves_steps_without_decodes_alone() -> None:
    rng = random.Random(4)
    h = Harness(max_num_batched_tokens=16, max_prefill_tokens_while_decoding=3)
    h.add("a", _prompt(rng, 12), max_tokens=2)
    h.add("b", _prompt(rng, 3), max_tokens=2)
    h.step()
    assert [s.num_tokens for s in h.executor.steps[-1].seqs] == [12, 3]
    h.run()


def test_chunked_prefill_positions_and_sampling() -> None:
    rng = random.Random(2)
    h = Harness(max_num_batched_tokens=8)
    h.add("a", _prompt(rng, 20), max_tokens=4)
    for start, n, sample in [(0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True)]:
        h.step()
        (seq,) = h.executor.steps[-1].seqs
        assert (seq.start_pos, seq.num_tokens, seq.sample) == (start, n, sample)
        assert len(seq.block_ids) == -(-(start + n) // 4)  # blocks for computed + this chunk only
    h.run()
    assert h.tokens["a"] == h.expected("a") and h.reasons["a"] == "length"


@pytest.mark.parametrize(("budget", "max_seqs"), [(5, 2), (16, 3), (3, 8)])
def test_budget_and_max_num_seqs_are_respected(budget: int, max_seqs: int) -> None:
    rng = random.Random(budget)
    h = Harness(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    for i in range(7):
        h.add(f"r{i}", _prompt(rng, rng.randrange(1, 15)), max_tokens=rng.randrange(1, 6))
    while h.core.has_unfinished():
        h.step()
        scheduled = h.executor.steps[-1]
        assert 0 < scheduled.num_batched_tokens <= budget
        assert len(scheduled.seqs) <= max_seqs and len(h.core.scheduler.running) <= max_seqs
    h.run()
    for rid in h.tokens:
        assert h.tokens[rid] == h.expected(rid)


def test_preempts_most_recently_admitted_and_resumes() -> None:
    rng = random.Random(3)
    h = Harness(num_blocks=6, max_num_batched_tokens=64)
    for rid in "abc":
        h.add(rid, _prompt(rng, 7), max_tokens=6)  # two blocks each: the cache is full after admission
    h.step()
    assert [r.request_id for r in h.core.scheduler.running] == ["a", "b", "c"]
    h.step()  # position 7 still fits in each second block
    h.step()  # a needs a third block: c, the last admitted, gives its blocks back
    assert h.executor.steps[-1].preempted_request_ids == ["c"]
    assert {s.request_id for s in h.executor.steps[-1].seqs} == {"a", "b"}
    assert h.requests["c"].status is RequestStatus.PREEMPTED and h.requests["c"].block_ids == []
    assert [r.request_id for r in h.core.scheduler.waiting] == ["c"]
    h.run()
    assert h.requests["c"].num_preemptions >= 1
    for rid in "abc":
        assert h.tokens[rid] == h.expected(rid) and h.reasons[rid] == "length"


def test_oldest_request_is_scheduled_every_step() -> None:
    rng = random.Random(4)
    h = Harness(num_blocks=10, max_num_batched_tokens=6, max_num_seqs=4)
    order = []
    for i in range(8):
        rid = f"r{i}"
        h.add(rid, _prompt(rng, rng.randrange(3, 12)), max_tokens=rng.randrange(4, 12))
        order.append(rid)
    for _ in range(500):
        if not h.core.has_unfinished():
            break
        oldest = next(rid for rid in order if rid not in h.reasons)
        h.step()
        assert oldest in {s.request_id for s in h.executor.steps[-1].seqs}, f"{oldest} starved"
    h.run()
    assert h.core.stats().num_preemptions > 0
    for rid in order:
        assert h.tokens[rid] == h.expected(rid)


def test_abort_waiting_running_and_preempted() -> None:
    rng = random.Random(5)
    h = Harness(num_blocks=6, max_num_batched_tokens=64, max_num_seqs=3)
    for rid in "abcd":
        h.add(rid, _prompt(rng, 7), max_tokens=6)
    h.step()
    h.step()
    h.step()  # c preempted, d still waiting
    for rid, status in [("d", RequestStatus.WAITING), ("c", RequestStatus.PREEMPTED), ("a", RequestStatus.RUNNING)]:
        assert h.requests[rid].status is status
        delta = h.abort(rid)
        assert delta is not None and delta.finish_reason == "abort" and delta.new_token_ids == []
        assert h.requests[rid].block_ids == [] and h.requests[rid].is_finished
        assert h.abort(rid) is None  # a second abort is a no-op
    assert h.abort("never-added") is None
    h.run()
    assert h.tokens["b"] == h.expected("b") and h.reasons["b"] == "length"
    assert h.abort("b") is None  # already finished


def test_runner_hears_of_requests_finished_before_an_empty_step() -> None:
    """Regression: an abort followed by an empty step lost the finished id; the runner kept its state."""
    rng = random.Random(6)
    h = Harness()
    h.add("a", _prompt(rng, 5), max_tokens=8)
    h.step()
    assert h.executor.known_requests == {"a"}
    h.abort("a")
    assert h.step() == []  # nothing to run: not executed
    h.add("b", _prompt(rng, 5), max_tokens=2)
    h.step()
    assert "a" in h.executor.steps[-1].finished_request_ids
    assert h.executor.known_requests == {"b"}
    h.run()
    assert h.tokens["b"] == h.expected("b")


def test_prefix_hit_skips_cached_tokens() -> None:
    rng = random.Random(7)
    h = Harness(max_num_batched_tokens=64)
    prompt = _prompt(rng, 12)
    h.add("a", prompt, max_tokens=3)
    h.run()
    h.add("b", list(prompt), max_tokens=3)  # a full-prompt hit on a block multiple
    h.step()
    (seq,) = h.executor.steps[-1].seqs
    assert seq.start_pos == 8 and seq.input_token_ids == prompt[8:]
    assert h.core.last_step.num_prefill_tokens == 4 and h.core.last_step.num_decode_tokens == 0
    h.add("c", [*prompt[:4], *_prompt(rng, 3)], max_tokens=3)
    h.step()
    assert {s.request_id: s.start_pos for s in h.executor.steps[-1].seqs}["c"] == 4
    h.run()
    assert h.tokens["b"] == h.tokens["a"] == h.expected("a")
    assert h.tokens["c"] == h.expected("c")
    assert h.core.stats().prefix_cache_hit_rate == pytest.approx((8 + 4) / (12 + 12 + 7))
    assert h.requests["b"].num_cached_tokens == 8


def test_a_request_scoring_its_prompt_takes_no_prefix_hit() -> None:
    """Prompt logprobs need every prompt position computed: a cached prefix is not taken (nor counted as a
    lookup), and the request's own blocks still enter the cache for the next one."""
    rng = random.Random(8)
    h = Harness(max_num_batched_tokens=64)
    prompt = _prompt(rng, 12)
    h.add("a", prompt, max_tokens=2)
    h.run()
    request = h.inputs.make_request("b", list(prompt), SamplingParams(max_tokens=2, prompt_logprobs=1), 0.0)
    h.core.add_request(request)
    h.tokens["b"] = []
    h.step()
    (seq,) = h.executor.steps[-1].seqs
    assert seq.start_pos == 0 and seq.input_token_ids == prompt
    assert request.num_cached_tokens == 0 and h.core.stats().prefix_cache_hit_rate == 0.0
    h.run()
    assert h.tokens["b"] == h.expected("a")
    h.add("c", list(prompt), max_tokens=2)
    h.step()
    assert h.executor.steps[-1].seqs[0].start_pos == 8  # the cache still serves others


def test_duplicate_live_request_id_is_rejected() -> None:
    h = Harness()
    h.add("a", [1, 2, 3], max_tokens=2)
    with pytest.raises(ValueError, match="already live"):
        h.add("a", [4, 5], max_tokens=2)
    h.run()
    assert h.tokens["a"] == h.expected("a")


# --------------------------------------------------------------------------- property test
_PREFIXES = [[], [7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10, 20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38]]

# (kind, prefix index, suffix, max_tokens, abort pick, steps); kinds 0-5 add, 6-7 step, 8-9 abort, so
# requests overlap: memory runs short (preemption) and prefixes repeat (hits).
_op = st.tuples(
    st.integers(0, 9),
    st.integers(0, len(_PREFIXES) - 1),
    st.lists(st.integers(1, 31), min_size=1, max_size=7),
    st.integers(4, 24),
    st.integers(0, 40),
    st.integers(1, 3),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_op, min_size=8, max_size=40),
    num_blocks=st.integers(8, 16),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(2, 24),
    prefill_cap=st.one_of(st.none(), st.integers(1, 8)),
    max_seqs=st.integers(1, 5),
    prefix_caching=st.booleans(),
    overlap=st.booleans(),
)
@pytest.mark.slow
def test_random_workloads_keep_invariants_and_outputs(
    ops: list,
    num_blocks: int,
    block_size: int,
    budget: int,
    prefill_cap: int | None,
    max_seqs: int,
    prefix_caching: bool,
    overlap: bool,
) -> None:
    h = Harness(
        num_blocks=num_blocks,
        block_size=block_size,
        next_token=hash_next_token(32),  # EOS (0) can come up: some requests stop early
        max_num_batched_tokens=budget,
        max_prefill_tokens_while_decoding=prefill_cap,
        max_num_seqs=max_seqs,
        enable_prefix_caching=prefix_caching,
        overlap=overlap,
    )
    added: list[str] = []
    aborted: set[str] = set()
    for kind, prefix, suffix, max_tokens, pick, steps in ops:
        if kind <= 5:
            rid = f"r{len(added)}"
            try:
                h.add(rid, [*_PREFIXES[prefix], *suffix], max_tokens)
            except InvalidRequestError as e:
                assert "KV cache" in str(e)  # only a prompt too big for this tiny cache is refused
                continue
            added.append(rid)
        elif kind <= 7:
            for _ in range(steps):
                h.step()
        elif added:
            rid = added[pick % len(added)]
            if h.abort(rid) is not None:
                aborted.add(rid)
    h.run(max_steps=3000)
    stats = h.core.stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hit_rate > 0}")
    event(f"chunked: {any(not s.sample for step in h.executor.steps for s in step.seqs)}")
    event(f"aborted: {bool(aborted)}")
    event(f"overlap: {overlap}")
    for rid in added:
        if rid in aborted:
            assert h.reasons[rid] == "abort"
            assert h.tokens[rid] == h.expected(rid)[: len(h.tokens[rid])]
        else:
            expected = h.expected(rid)
            assert h.tokens[rid] == expected
            assert h.reasons[rid] == ("stop" if expected[-1] in EOS else "length")
    # The runner dropped every finished request except those it hears of with the next executed step.
    assert h.executor.known_requests <= set(h.core.scheduler.pending_finished_ids)
    # And heard of every preemption (a resumed request's block-table row is rewritten), those of steps that ran
    # no model included: each was followed by its request's resumption.
    assert sum(len(step.preempted_request_ids) for step in h.executor.steps) == stats.num_preemptions
