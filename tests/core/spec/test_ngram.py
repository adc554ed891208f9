"""The n-gram drafter: its incremental index proposes what a full rescan of the sequence would."""

from __future__ import annotations

import random

import pytest

from asyncllm.core.spec.ngram import NgramDrafter


def _rescan(tokens: list[int], k: int, lo: int, hi: int, limit: int) -> list[int]:
    """The specification: the longest tail n-gram (hi down to lo) with an earlier occurrence; what followed its
    latest earlier occurrence."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        tail = tokens[size - n :]
        for end in range(size - 1, n - 1, -1):
            if tokens[end - n : end] == tail:
                return tokens[end : end + min(k, limit)]
    return []


def test_proposes_the_continuation_of_the_latest_earlier_occurrence() -> None:
    d = NgramDrafter(4, 2, 5)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert d.propose("a", tokens, 10) == [4, 5, 9, 1]
    assert d.propose("a", [*tokens, 4], 2) == [5, 9]  # capped by the limit
    assert d.propose("a", [*tokens, 4, 7], 10) == []  # (4, 7) never occurred before
    assert d.propose("b", [1, 2, 3], 10) == []  # another request's index is its own
    assert d.propose("a", [*tokens, 4], 0) == []


@pytest.mark.parametrize("seed", range(20))
def test_incremental_index_matches_a_rescan(seed: int) -> None:
    rng = random.Random(seed)
    lo, hi, k = rng.randint(1, 3), rng.randint(3, 5), rng.randint(1, 6)
    d = NgramDrafter(k, lo, hi)
    tokens = [rng.randrange(6) for _ in range(rng.randint(1, 12))]
    for _ in range(60):
        limit = rng.randint(0, 8)
        assert d.propose("r", tokens, limit) == _rescan(tokens, k, lo, hi, limit), tokens
        tokens += [rng.randrange(6) for _ in range(rng.randint(1, 4))]  # a step appends one or several
    d.forget("r", [])
    d.forget("r", [])  # idempotent


def test_refuses_bad_bounds() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(4, 3, 2)


def test_drafts_ahead_are_looked_past_but_never_indexed() -> None:
    """`propose_ahead` (chained verification) continues past drafts still being verified without indexing them:
    once they are rejected, the request's proposals are what a rescan of its real tokens gives."""
    d = NgramDrafter(4, 2, 5)
    known = [1, 2, 3, 4, 5, 6, 1, 2]
    assert d.propose_ahead("a", known, [3, 4], 10) == [5, 6, 1, 2]  # (2, 3, 4) occurred at the start
    later = [*known, 7, 8, 2, 3]  # the drafts 3, 4 were rejected: 7 came instead
    assert d.propose("a", later, 10) == _rescan(later, 4, 2, 5, 10) == [4, 5, 6, 1]
