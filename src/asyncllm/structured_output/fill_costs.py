"""`FillCosts`: what each constrained request's matcher costs the step thread (the CPU time of accepting a
token and filling the next bitmask row), and which constraints are slow. A request whose cost passes the
bound (ASYNCLLM_GRAMMAR_SLOW_FILL_MS) has its matcher moved to the slow lane (`slow_lane.py`), off the step
every request shares, and its constraint is remembered so that later requests with it start there.

Why a bound per request and not per step: a step's fill time grows with its constrained rows (256 rows of
an ordinary schema over a 150k vocabulary take ~5 ms on one core, and they are the batch's own work), while
a single row of a constraint xgrammar cannot turn into an automaton (a 20,000-string enum, a choice or regex
of as many alternatives) costs 3-10 ms to fill and 1-3 ms to accept at its widest states, for one request,
where an ordinary row costs microseconds. CPU time of the thread, not wall time: a loaded host's preemptions
must not mark an ordinary constraint slow. Plain Python; knows nothing of steps, rows or devices.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from asyncllm.structured import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's batch fill (`matcher_set.BatchFill`): bitmask rows `rows` of `bits` from the matchers' next masks.
BatchFill = Callable[[list["xgr.GrammarMatcher"], np.ndarray, list[int]], None]

SLOW_SPECS = 1024  # constraints remembered as slow, least recently marked out first
_EMA = 0.5  # weight of a request's latest row in its cost: two slow rows in a row pass a bound half their cost
TIMED_MAX_ROWS = 16  # parts up to this many rows are accepted and filled a row at a time, each timed


class FillCosts:
    """Per slot, a moving average of its rows' cost in seconds; `observe` says when a slot turns slow.
    `bound_s` None: nothing is ever slow (the lane is off)."""

    def __init__(self, bound_s: float | None) -> None:
        self.bound_s = bound_s
        self._cost: dict[int, float] = {}
        self._slow: OrderedDict[StructuredOutput, None] = OrderedDict()

    def is_slow(self, spec: StructuredOutput) -> bool:
        """A request with this constraint was found slow: later ones start in the slow lane."""
        if spec in self._slow:
            self._slow.move_to_end(spec)
            return True
        return False

    def mark_slow(self, spec: StructuredOutput) -> None:
        self._slow[spec] = None
        self._slow.move_to_end(spec)
        if len(self._slow) > SLOW_SPECS:
            self._slow.popitem(last=False)

    def observe(self, slots: Sequence[int], seconds: Sequence[float]) -> list[int]:
        """Each slot's latest row cost; the slots whose average just passed the bound."""
        bound = self.bound_s
        if bound is None:
            return []
        cost, slow = self._cost, []
        for slot, s in zip(slots, seconds):
            was = cost.get(slot)
            now = s if was is None else was + _EMA * (s - was)
            cost[slot] = now
            if now > bound >= (was or 0.0):
                slow.append(slot)
        return slow

    def forget(self, slot: int) -> None:
        self._cost.pop(slot, None)


class TimedRows:
    """A `MatcherSet`'s timer: what each slot's accepts and fills cost in one home call, summed per slot, for
    the home to `take` (and fold into `FillCosts`). Parts of up to `TIMED_MAX_ROWS` rows go a row at a time,
    each call timed on this thread's CPU clock (a call's overhead is ~1 us); a larger part goes in one batch
    call (perhaps on xgrammar's threads), its wall time spread evenly over its rows."""

    def __init__(self) -> None:
        self._cost: dict[int, float] = {}

    def take(self) -> tuple[list[int], list[float]]:
        cost, self._cost = self._cost, {}
        return list(cost), list(cost.values())

    def spread(self, slots: list[int], seconds: float) -> None:
        """A batch call over `slots` took `seconds`."""
        if slots:
            share, cost = seconds / len(slots), self._cost
            for slot in slots:
                cost[slot] = cost.get(slot, 0.0) + share

    def accept_and_fill(
        self,
        matchers: list[xgr.GrammarMatcher],
        slots: list[int],
        tokens: list[int],
        ends: Sequence[bool],
        bits: np.ndarray,
        rows: list[int],
    ) -> list[bool]:
        """Each matcher accepts its token, then fills its row unless the token was refused or ends its output
        (`ends`), one call each, timed; whether each token was accepted."""
        clock, cost = time.thread_time, self._cost
        took: list[bool] = []
        for i, matcher in enumerate(matchers):
            start = clock()
            ok = matcher.accept_token(tokens[i])
            if ok and not ends[i]:
                matcher.fill_next_token_bitmask(bits, rows[i])
            cost[slots[i]] = cost.get(slots[i], 0.0) + clock() - start
            took.append(ok)
        return took

    def accept(self, matchers: list[xgr.GrammarMatcher], slots: list[int], tokens: list[int]) -> list[bool]:
        """Each matcher accepts its token (xgrammar's batch call for many); whether it did."""
        if len(matchers) > TIMED_MAX_ROWS:
            from xgrammar import BatchGrammarMatcher  # loaded by the compile that made the matchers

            start = time.perf_counter()
            took: list[bool] = BatchGrammarMatcher.batch_accept_token(matchers, tokens)
            self.spread(slots, time.perf_counter() - start)
            return took
        return self.accept_and_fill(matchers, slots, tokens, [True] * len(matchers), np.empty(0), [])

    def fill(
        self,
        batch_fill: BatchFill,
        matchers: list[xgr.GrammarMatcher],
        slots: list[int],
        bits: np.ndarray,
        rows: list[int],
    ) -> None:
        """bits[rows[i]] is matchers[i]'s next mask (`batch_fill` for many)."""
        if len(matchers) > TIMED_MAX_ROWS:
            start = time.perf_counter()
            batch_fill(matchers, bits, rows)
            self.spread(slots, time.perf_counter() - start)
            return
        clock, cost = time.thread_time, self._cost
        for matcher, slot, row in zip(matchers, slots, rows):
            start = clock()
            matcher.fill_next_token_bitmask(bits, row)
            cost[slot] = cost.get(slot, 0.0) + clock() - start
