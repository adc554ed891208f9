"""Several samples per prompt in the core (`SamplingParams.n`): one prefill, shared blocks, every sample
right, every block freed once, however the samples end.

Over a FakeExecutor whose "KV cache" holds token ids read back through each sequence's block table: a
sample reading a sibling's block that does not hold its prompt (or its own tail) changes its tokens.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncllm.core.engine_core import EngineCore
from asyncllm.core.output_processor import RequestDelta
from asyncllm.errors import InvalidRequestError
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from tests.core.invariants import check_block_invariants
from tests.fixtures.fake_executor import FakeExecutor, hash_next_token, make_engine_core, make_runtime, reference_tokens

EOS = frozenset({0})


class Samples:
    """An EngineCore over a FakeExecutor, collecting deltas by (request, sample) and checking the block
    accounting (sample groups' own references included) after every step and abort."""

    def __init__(self, *, num_blocks: int = 64, block_size: int = 4, next_token=None, overlap: bool = False, **kw):
        self.runtime = make_runtime(num_kv_blocks=num_blocks, block_size=block_size, eos_token_ids=EOS)
        self.executor = FakeExecutor(self.runtime, next_token=next_token, asynchronous=overlap)
        self.core: EngineCore = make_engine_core(self.executor, **kw)
        self.inputs = InputProcessor(self.runtime, None)
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.reasons: dict[tuple[str, int], str] = {}
        self.final: dict[str, int] = Counter()  # request id -> deltas that closed the whole request
        self.prompts: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int | None] = {}

    def add(self, rid: str, prompt: list[int], n: int, max_tokens: int | None = None, **params) -> None:
        request = self.inputs.make_request(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens, **params), 0.0)
        self.core.add_request(request)
        self.prompts[rid], self.max_tokens[rid] = prompt, request.max_tokens
        for i in range(n):
            self.tokens[rid, i] = []

    def _take(self, delta: RequestDelta) -> None:
        key = (delta.request_id, delta.index)
        assert key in self.tokens, f"a delta for an unknown sample {key}"
        assert key not in self.reasons, f"{key} got output after it finished"
        self.tokens[key].extend(delta.new_token_ids)
        if delta.finish_reason is not None:
            self.reasons[key] = delta.finish_reason
            if not delta.open_samples:
                self.final[delta.request_id] += 1

    def check(self) -> None:
        core = self.core
        check_block_invariants(core.block_manager, core.scheduler.requests.values(), core.scheduler.held_block_ids())

    def step(self) -> None:
        for delta in self.core.step():
            self._take(delta)
        self.check()

    def abort(self, rid: str) -> list[RequestDelta]:
        deltas = self.core.abort(rid)
        for delta in deltas:
            self._take(delta)
        self.check()
        return deltas

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.core.has_unfinished():
                return
            self.step()
        raise AssertionError("requests did not finish in bounded steps")

    def expected(self, rid: str) -> list[int]:
        max_tokens = self.max_tokens[rid]
        assert max_tokens is not None
        return reference_tokens(self.executor.next_token, self.prompts[rid], max_tokens, EOS)

    def first_seqs(self, rid: str) -> dict[str, tuple[int, int]]:
        """Each sample's first scheduled slice: sample id -> (start position, number of tokens)."""
        first: dict[str, tuple[int, int]] = {}
        for step in self.executor.steps:
            for seq in step.seqs:
                if seq.request_id.startswith(f"{rid}[") and seq.request_id not in first:
                    first[seq.request_id] = (seq.start_pos, seq.num_tokens)
        return first


def test_the_prompt_is_computed_once_and_its_full_blocks_shared() -> None:
    h = Samples(num_blocks=64, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks shared, the tail (2 tokens) computed by each
    h.add("r", prompt, n=4, max_tokens=6, ignore_eos=True)
    h.step()
    first = h.first_seqs("r")
    assert first == {"r[0]": (0, 14), "r[1]": (12, 2), "r[2]": (12, 2), "r[3]": (12, 2)}
    # 3 shared blocks + each sample's own tail block, against 4 x 4 blocks for four requests.
    assert h.core.stats().num_free_blocks == 64 - (3 + 4)
    h.run()
    assert all(h.tokens["r", i] == h.expected("r") for i in range(4))
    assert h.final["r"] == 1 and all(h.reasons["r", i] == "length" for i in range(4))
    assert h.core.stats().num_free_blocks == 64


def test_each_sample_gets_its_own_derived_seed() -> None:
    h = Samples()
    h.add("s", [1, 2, 3], n=3, max_tokens=2, seed=41)
    h.add("u", [1, 2, 3], n=3, max_tokens=2)
    h.run()
    seeds = {new.request_id: new.seed for step in h.executor.steps for new in step.new_requests}
    assert [seeds[f"s[{i}]"] for i in range(3)] == [41, 42, 43]
    assert len({seeds[f"u[{i}]"] for i in range(3)}) == 3  # unseeded: each its own draw


def test_a_prompt_shorter_than_a_block_shares_nothing_and_waits_for_nothing() -> None:
    h = Samples(block_size=4)
    h.add("r", [5, 6, 7], n=3, max_tokens=3, ignore_eos=True)
    h.step()
    assert h.first_seqs("r") == {"r[0]": (0, 3), "r[1]": (0, 3), "r[2]": (0, 3)}
    h.run()
    assert h.core.stats().num_free_blocks == h.runtime.num_kv_blocks


def test_samples_wait_for_the_chunked_prefill_then_share_it() -> None:
    """The first sample's prompt comes in chunks: the others wait for its blocks instead of computing them."""
    h = Samples(block_size=4, max_num_batched_tokens=8)
    h.add("r", list(range(1, 22)), n=3, max_tokens=2, ignore_eos=True)  # 21 tokens: 5 shared blocks
    h.run()
    assert h.first_seqs("r") == {"r[0]": (0, 8), "r[1]": (20, 1), "r[2]": (20, 1)}
    assert all(h.tokens["r", i] == h.expected("r") for i in range(3))


def test_prompt_logprobs_are_scored_by_sample_0_alone() -> None:
    """The request's prompt logprobs: sample 0 asks for them and computes the whole prompt; the others do not
    ask, and share its blocks as usual."""
    h = Samples(block_size=4, max_num_batched_tokens=8)
    h.add("r", list(range(1, 22)), n=3, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    h.run()
    assert h.first_seqs("r") == {"r[0]": (0, 8), "r[1]": (20, 1), "r[2]": (20, 1)}
    asked = {new.request_id: new.params.prompt_logprobs for step in h.executor.steps for new in step.new_requests}
    assert asked == {"r[0]": 2, "r[1]": None, "r[2]": None}
    assert all(h.tokens["r", i] == h.expected("r") for i in range(3))


def test_samples_admitted_after_the_first_one_finished_still_share_its_blocks() -> None:
    """One seat: the first sample runs (and ends) before the others are admitted; the group keeps the
    prompt's blocks for them (the prefix cache is off), and lets go once the last is admitted."""
    h = Samples(block_size=4, max_num_seqs=1, enable_prefix_caching=False)
    h.add("r", list(range(1, 11)), n=3, max_tokens=2, ignore_eos=True)  # 2 shared blocks
    h.run()
    assert h.first_seqs("r") == {"r[0]": (0, 10), "r[1]": (8, 2), "r[2]": (8, 2)}
    assert all(h.tokens["r", i] == h.expected("r") for i in range(3))
    assert h.core.scheduler.held_block_ids() == [] and h.core.stats().num_free_blocks == h.runtime.num_kv_blocks


def test_aborting_the_request_ends_every_sample_and_frees_every_block() -> None:
    h = Samples(block_size=4, max_num_seqs=2)
    h.add("r", list(range(1, 11)), n=4, max_tokens=20, ignore_eos=True)
    for _ in range(3):
        h.step()
    deltas = h.abort("r")
    assert sorted(d.index for d in deltas) == [0, 1, 2, 3]  # two running, two still waiting
    assert [d.open_samples for d in deltas] == [3, 2, 1, 0] and all(d.request_id == "r" for d in deltas)
    assert h.abort("r") == [] and h.core.abort_request("r") is None
    assert not h.core.has_unfinished() or h.core.scheduler.requests == {}
    assert h.core.stats().num_free_blocks == h.runtime.num_kv_blocks
    assert h.final["r"] == 1


def test_preempting_a_sample_keeps_the_blocks_its_siblings_read() -> None:
    """Memory for the prompt and two tails only: the newest sample is preempted, its siblings go on reading
    the shared blocks, and it resumes by sharing them again."""
    h = Samples(num_blocks=6, block_size=4, max_num_batched_tokens=32)
    h.add("r", list(range(1, 10)), n=3, max_tokens=8, ignore_eos=True)  # 2 shared blocks, 1 each to start
    h.run()
    assert h.core.stats().num_preemptions > 0
    assert all(h.tokens["r", i] == h.expected("r") for i in range(3))
    assert h.core.stats().num_free_blocks == 6


def test_samples_stop_on_their_own() -> None:
    """Each sample has its own stop and length: the request ends when the last one does."""
    h = Samples(next_token=hash_next_token(8), block_size=4)  # EOS (0) comes up often in 8 ids
    h.add("r", [3, 1, 4, 1, 5, 9], n=2, max_tokens=30)
    h.add("q", [2, 7, 1, 8, 2, 8], n=5, max_tokens=30, min_tokens=3)
    h.run()
    for rid, n in (("r", 2), ("q", 5)):
        expected = h.expected(rid)
        for i in range(n):
            assert h.tokens[rid, i] == expected
            assert h.reasons[rid, i] == ("stop" if expected[-1] in EOS else "length")
        assert h.final[rid] == 1


def test_taken_ids_are_refused_before_anything_is_added() -> None:
    h = Samples()
    h.add("x[1]", [1, 2], n=1, max_tokens=2)
    with pytest.raises(InvalidRequestError, match=r"x\[1\]"):
        h.add("x", [1, 2, 3], n=2, max_tokens=2)
    assert set(h.core.scheduler.requests) == {"x[1]"}
    h.add("y", [1, 2, 3], n=2, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="'y' is already live"):
        h.add("y", [4], n=1, max_tokens=2)


_PREFIXES = [[7, 3, 9, 1, 4, 4, 2, 8], [5, 5, 6, 1, 2, 3], [9]]
_op = st.tuples(
    st.integers(0, 9),  # 0-5: add, 6-7: steps, 8-9: abort
    st.integers(0, len(_PREFIXES) - 1),
    st.lists(st.integers(1, 31), min_size=0, max_size=9),
    st.one_of(st.none(), st.integers(1, 12)),
    st.integers(1, 4),  # n
    st.integers(0, 40),
    st.integers(1, 3),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_op, min_size=6, max_size=30),
    num_blocks=st.integers(8, 20),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(2, 24),
    max_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    overlap=st.booleans(),
)
@pytest.mark.slow
def test_random_workloads_with_samples_keep_invariants_and_outputs(
    ops: list, num_blocks: int, block_size: int, budget: int, max_seqs: int, prefix_caching: bool, overlap: bool
) -> None:
    h = Samples(
        num_blocks=num_blocks,
        block_size=block_size,
        next_token=hash_next_token(32),
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_prefix_caching=prefix_caching,
        overlap=overlap,
    )
    added: dict[str, int] = {}
    aborted: set[str] = set()
    for kind, prefix, suffix, max_tokens, n, pick, steps in ops:
        if kind <= 5:
            rid = f"r{len(added)}"
            try:
                h.add(rid, [*_PREFIXES[prefix], *suffix], n, max_tokens)
            except InvalidRequestError as e:
                assert "KV cache" in str(e)
                continue
            added[rid] = n
        elif kind <= 7:
            for _ in range(steps):
                h.step()
        elif added:
            rid = list(added)[pick % len(added)]
            if h.abort(rid):
                aborted.add(rid)
    h.run()
    event(f"preempted: {h.core.stats().num_preemptions > 0}")
    event(f"aborted: {bool(aborted)}")
    for rid, n in added.items():
        expected = h.expected(rid)
        assert h.final[rid] == 1, f"{rid}: the request's output must close exactly once"
        for i in range(n):
            if h.reasons[rid, i] == "abort":
                assert rid in aborted and h.tokens[rid, i] == expected[: len(h.tokens[rid, i])]
            else:
                assert h.tokens[rid, i] == expected
                assert h.reasons[rid, i] == ("stop" if expected[-1] in EOS else "length")
    assert h.core.scheduler.held_block_ids() == []
    assert h.core.stats().num_free_blocks == num_blocks


def test_random_prompts_of_every_length_around_a_block_boundary() -> None:
    rng = random.Random(0)
    for length in range(1, 14):
        h = Samples(block_size=4, max_num_batched_tokens=rng.choice([3, 8, 64]))
        h.add("r", [rng.randrange(1, 60) for _ in range(length)], n=3, max_tokens=4, ignore_eos=True)
        h.run()
        assert all(h.tokens["r", i] == h.expected("r") for i in range(3)), length
        assert h.core.stats().num_free_blocks == h.runtime.num_kv_blocks


class _FailsOneSample(FakeExecutor):
    """Reports that `victim` cannot go on (its constraint allows no token) the third time it samples."""

    def __init__(self, runtime, victim: str) -> None:
        super().__init__(runtime)
        self.victim = victim
        self.seen = 0

    def execute_model(self, scheduled):
        out = super().execute_model(scheduled)
        rows = [s.request_id for s in scheduled.seqs if s.sample]
        if self.victim in rows:
            self.seen += 1
            if self.seen == 3:
                return dataclasses.replace(out, failed={rows.index(self.victim): "no token can continue"})
        return out


def test_a_sample_that_cannot_go_on_ends_the_whole_request_with_its_error() -> None:
    h = Samples()
    h.executor = _FailsOneSample(h.runtime, "r[1]")
    h.core = make_engine_core(h.executor)
    h.add("r", list(range(1, 10)), n=3, max_tokens=20, ignore_eos=True)
    h.add("other", [4, 5, 6], n=1, max_tokens=8, ignore_eos=True)
    deltas: list[RequestDelta] = []
    while h.core.has_unfinished():
        deltas += h.core.step()
        h.check()
    ends = [d for d in deltas if d.request_id == "r" and (d.finish_reason or d.error)]
    assert [(d.index, d.finish_reason, d.error) for d in ends] == [
        (0, "abort", None),
        (2, "abort", None),
        (1, "abort", "no token can continue"),
    ]
    assert [d.open_samples for d in ends] == [2, 1, 0]
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "other") == 8  # carries on
    assert h.core.stats().num_free_blocks == h.runtime.num_kv_blocks
