"""The slow lane's parts: `FillCosts` finds a request slow once its average cost per row passes the bound
(and remembers its constraint), and the `SlowLane` gives exactly the rows a request's own matcher would,
whether it walks a path no request walked before or takes a copy of one seen (many requests with one
constraint, their outputs sharing a beginning), and so do its rows for a request's drafts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from asyncllm import SamplingParams
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.draft_fill import accept_runs, fill_after_drafts
from asyncllm.structured_output.fill_costs import SLOW_SPECS, FillCosts
from asyncllm.structured_output.matcher_set import MatcherSet
from asyncllm.structured_output.slow_lane import SEEN_TOKENS, SlowLane

VOCAB = 384
WORDS = (VOCAB + 31) // 32
SCHEMA = {
    "type": "array",
    "items": {"enum": ["alpha", "alps", "beta", "bet", "gamma", "日本", "x y z"]},
    "minItems": 1,
    "maxItems": 4,
}


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> GrammarBackend:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return GrammarBackend(tokenizer, VOCAB, [tokenizer.eos_token_id])


def test_a_request_is_slow_once_its_average_passes_the_bound() -> None:
    costs = FillCosts(0.001)
    assert costs.observe([1, 2], [0.0001, 0.0005]) == []
    assert costs.observe([1, 2], [0.0030, 0.0006]) == [1]  # 1: (0.1 + 3.0) / 2 ms; 2: 0.55 ms
    assert costs.observe([1, 2], [0.0030, 0.0005]) == []  # 1 was slow already; 2 stays under
    costs.forget(1)
    assert costs.observe([1], [0.002]) == [1]  # a new request in that slot starts afresh
    assert FillCosts(None).observe([1], [10.0]) == []  # no bound: nothing is slow
    spec = SamplingParams(regex="a+").structured
    assert spec is not None and not costs.is_slow(spec)
    costs.mark_slow(spec)
    assert costs.is_slow(spec)
    for i in range(SLOW_SPECS):  # the least recently marked (or asked) goes first
        other = SamplingParams(regex=f"b{i}").structured
        assert other is not None
        costs.mark_slow(other)
    assert not costs.is_slow(spec)


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB])


def _lane_and_reference(backend: GrammarBackend) -> tuple[SlowLane, MatcherSet, Any]:
    """A lane and the step thread's matchers it must agree with, and the one-thread `spread` the latter fill with."""
    from xgrammar import BatchGrammarMatcher  # loaded with the backend's compiles

    fill = BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask

    def spread(n, share):  # type: ignore[no-untyped-def]
        share(fill, 0, n)

    return SlowLane(backend, WORDS), MatcherSet(backend, WORDS), spread


def test_the_lane_gives_each_request_its_own_matchers_rows_seen_paths_included(backend: GrammarBackend) -> None:
    spec = SamplingParams(json_schema=SCHEMA).structured
    assert spec is not None
    lane, reference, spread = _lane_and_reference(backend)

    rng = random.Random(0)
    try:
        for request in range(12):  # requests one after another in slots taken again, most sharing a beginning
            slot = request % 3
            lane.add(slot, spec)
            reference.add(slot, spec)
            shared = random.Random(request % 4)  # requests 0, 4, 8 draw the same first tokens, and so on
            mine, mine_states = np.zeros((1, WORDS), np.int32), np.zeros(1, np.int64)
            want, want_states = np.zeros((1, WORDS), np.int32), np.zeros(1, np.int64)
            reference.fill(want, want_states, [0], [slot], spread)
            for position in range(SEEN_TOKENS + 4):  # past the remembered paths' length
                assert lane.take(slot, mine, mine_states, 0) is None
                assert (mine == want).all() and mine_states[0] == want_states[0], (request, position)
                allowed = _allowed(want[0])
                picker = shared if position < 5 else rng
                token = int(allowed[picker.randrange(len(allowed))])
                lane.step([slot], [token])
                refused, errors = reference.step(want, want_states, [0], [slot], [token], spread)
                assert not refused and not errors
                if token in backend.stop_token_ids:
                    break
            lane.remove(slot)
            reference.remove(slot)
    finally:
        lane.close()


def test_the_lanes_drafted_rows_and_accepted_runs_are_its_own_matchers(backend: GrammarBackend) -> None:
    """Speculative decoding in the lane: a request's rows after each of its drafts (`SlowLane.draft`) are the
    rows its own matcher gives after them (`fill_after_drafts`, drafts refused by the grammar included), the
    matcher then standing where it stood; a verified step's accepted tokens before its last (`step`'s leads)
    advance it by exactly those tokens, seen paths included (requests 0 and 3, 1 and 4 share a beginning)."""
    spec = SamplingParams(json_schema=SCHEMA).structured
    assert spec is not None
    lane, reference, spread = _lane_and_reference(backend)

    def after(slot: int, drafts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        bits, states = np.zeros((len(drafts), WORDS), np.int32), np.zeros(len(drafts), np.int64)
        fill_after_drafts(reference, bits, states, slot, range(len(drafts)), drafts)
        return bits, states

    rng = random.Random(1)
    try:
        for request in range(6):
            slot = request % 2
            lane.add(slot, spec)
            reference.add(slot, spec)
            shared = random.Random(request % 3)
            want, want_states = np.zeros((1, WORDS), np.int32), np.zeros(1, np.int64)
            reference.fill(want, want_states, [0], [slot], spread)
            mine, mine_states = np.zeros((1, WORDS), np.int32), np.zeros(1, np.int64)
            for position in range(SEEN_TOKENS + 4):
                assert lane.take(slot, mine, mine_states, 0) is None
                assert (mine == want).all() and mine_states[0] == want_states[0], (request, position)
                picker = shared if position < 3 else rng
                drafts: list[int] = []  # a path the grammar allows, its last draft sometimes any token
                row = want[0]
                for _ in range(4):
                    allowed = _allowed(row)
                    drafts.append(int(allowed[picker.randrange(len(allowed))]))
                    if drafts[-1] in backend.stop_token_ids:
                        break
                    row = after(slot, drafts)[0][-1]
                if picker.random() < 0.3:
                    drafts[-1] = picker.randrange(VOCAB)
                bits, states = lane.draft(slot, drafts).result()
                want_bits, want_draft_states = after(slot, drafts)
                assert (bits == want_bits).all() and (states == want_draft_states).all(), (request, position)
                # The target took `taken` drafts, then its own token (one the row after them allows).
                taken = picker.randrange(len(drafts))
                allowed = _allowed(want[0] if taken == 0 else after(slot, drafts[:taken])[0][-1])
                token = int(allowed[picker.randrange(len(allowed))])
                lane.step([slot], [token], [drafts[:taken]])
                assert not accept_runs(reference, [slot], [drafts[:taken]])
                refused, errors = reference.step(want, want_states, [0], [slot], [token], spread)
                assert not refused and not errors
                if token in backend.stop_token_ids:
                    break
            lane.remove(slot)
            reference.remove(slot)
    finally:
        lane.close()
