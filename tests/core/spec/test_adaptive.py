"""The draft length follows acceptance: down to one draft while drafts miss, back up one a step while they hit."""

from __future__ import annotations

from asyncllm.core.spec.adaptive import AdaptiveDrafter


class Fixed:
    """Proposes `limit` copies of 7; records what it was asked."""

    def __init__(self) -> None:
        self.limits: list[int] = []
        self.forgotten: list[tuple[str, list[int]]] = []

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        self.limits.append(limit)
        return [7] * limit

    def forget(self, request_id: str, output: list[int]) -> None:
        self.forgotten.append((request_id, output))


def test_misses_shrink_the_drafts_and_hits_grow_them_back() -> None:
    inner = Fixed()
    d = AdaptiveDrafter(inner, num_tokens=4)
    misses = []
    for _ in range(3):  # every draft wrong
        drafts = d.propose("r", [1, 2, 3], 16)
        misses.append(len(drafts))
        d.observe("r", len(drafts), 0)
    assert misses == [4, 1, 1]
    hits = []
    for _ in range(8):  # every draft right
        drafts = d.propose("r", [1, 2, 3], 16)
        hits.append(len(drafts))
        d.observe("r", len(drafts), len(drafts))
    assert hits == sorted(hits) and hits[0] == 1 and hits[-3:] == [4, 4, 4]
    assert len(d.propose("other", [1], 16)) == 4  # each request its own history
    assert len(d.propose("r", [1], 2)) == 2  # never past the room the scheduler gives


def test_forget_drops_the_history_and_passes_the_output_on() -> None:
    inner = Fixed()
    d = AdaptiveDrafter(inner, num_tokens=4)
    d.observe("r", 4, 0)
    assert d.cap("r") == 1
    d.forget("r", [5, 6])
    assert d.cap("r") == 4 and inner.forgotten == [("r", [5, 6])]
    d.observe("r", 0, 0)  # a step without drafts teaches nothing
    assert d.cap("r") == 4


def test_a_chain_is_expected_only_after_whole_runs_and_drafts_past_a_guess() -> None:
    """`expects_all` holds once a request's recent proposals were accepted whole; `propose_after` asks the method
    for one token more (the guess of the token in flight) and drops it, within the same cap."""
    inner = Fixed()
    d = AdaptiveDrafter(inner, num_tokens=4)
    assert not d.expects_all("r", 4)  # never verified yet
    d.observe("r", 4, 4)
    assert d.expects_all("r", 4) and not d.expects_all("other", 1)
    assert d.propose_after("r", [1], [2], 16) == [7] * 4 and inner.limits[-1] == 5
    assert d.propose_after("r", [1], [2], 2) == [7] * 2
    d.observe("r", 4, 3)  # one rejected: the average falls below a whole run
    assert not d.expects_all("r", 4)
