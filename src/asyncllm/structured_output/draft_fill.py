"""What a `MatcherSet` does for speculative drafts, wherever it lives (the step thread, the slow lane's thread,
the grammar process): fill the bitmask rows a request's drafts are verified under (`fill_after_drafts`: the
matcher accepts each draft, a row filled after it, then rolls back), and take a verified step's accepted
tokens before its last one (`accept_runs`). Knows nothing of steps' plans, homes or devices: rows index the
caller's arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asyncllm.structured_output.matcher_set import MatcherSet
from asyncllm.structured_output.utf8 import BOUNDARY


def fill_after_drafts(
    matchers: MatcherSet,
    bits: np.ndarray,
    states: np.ndarray,
    slot: int,
    rows: Sequence[int],
    drafts: Sequence[int],
    jumps: bool = False,
) -> int | None:
    """Row rows[j] of `bits` [rows, words] and `states` [rows] is the slot's mask after drafts[: j + 1], from
    where its matcher stands; the matcher stands there again after. A draft the grammar (or UTF-8) refuses
    ends that: the rows after it allow any token (their draws are never output: the row before drew under a
    mask refusing that draft, so verification stops there). A terminated or failed slot's rows allow its stop
    tokens alone. `jumps` (jump-forward): where the grammar forces text after a draft, that draft's row ends
    the run; the most drafts the step may accept then (the drafts before that one), else None."""
    rows = list(rows)
    bits[rows] = -1
    states[rows] = BOUNDARY
    matchers.resolve([slot])
    cursor = matchers.cursor(slot)
    if cursor is None:  # terminated: EOS alone, as its first row (or failed: nothing of it is output)
        bits[rows] = matchers.stop_row
        return None
    matcher, state = cursor
    assert matchers.backend is not None  # a made matcher's
    utf8_next = matchers.backend.utf8.next
    taken, cap = 0, None
    for row, token in zip(rows, drafts):
        state = int(utf8_next[state, token])
        if state < 0 or not matcher.accept_token(token):
            break
        taken += 1
        states[row] = state
        if matcher.is_terminated():  # a stop token: EOS alone after it, as for a terminated request
            bits[row] = matchers.stop_row
            break
        if jumps:  # text forced after this draft is output without draws: its row ends the run
            run, _ = matchers.forced_tokens().run(matcher, state)
            taken += len(run)
            if run:
                cap = taken - len(run) - 1  # the drafts before this one
                break
        matcher.fill_next_token_bitmask(bits, row)
    if taken:
        matcher.rollback(taken)
    return cap


def accept_runs(matchers: MatcherSet, slots: Sequence[int], runs: Sequence[Sequence[int]]) -> dict[int, str]:
    """slots[i] accepts runs[i] (a verified step's tokens before its last), position by position in one
    xgrammar call each; the refusals' errors by slot (each token was allowed by the row it was verified under:
    a refusal is a bug, ending the request)."""
    refused: dict[int, str] = {}
    for p in range(max(map(len, runs), default=0)):
        at = [(slot, run[p]) for slot, run in zip(slots, runs) if len(run) > p]
        refused.update(matchers.accept([slot for slot, _ in at], [token for _, token in at]))
    return refused
