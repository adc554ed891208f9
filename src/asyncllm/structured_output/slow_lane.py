"""`SlowLane`: the matchers of constrained requests that are slow to follow (`fill_costs.py`), on a thread of
their own beside the step thread, so that their work costs their own requests, not the step every request
shares. The step thread hands the lane a request's token once it is known (`step`: accepted there, and the
next bitmask row filled into the lane's own copy) and takes the row when the request's next draw is due
(`take`), if it is `ready`. A request whose row is not ready sits that draw out (`deferral.py`): its token is
drawn in a later step, and the core plans it again (`ModelRunnerOutput.deferred`).

xgrammar releases the GIL while it accepts and fills, so the lane's work runs beside the step thread's. One
thread runs the lane's work in the order handed: a slot's matcher is only ever touched there, and a slot
reused for another request finds the previous one's work done first. Knows nothing of steps' plans or devices.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from asyncllm.structured import StructuredOutput
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.matcher_set import BatchFill, MatcherSet

Moved = tuple[object, int, str]  # `MatcherSet.detach`'s: the matcher, its UTF-8 state, its field


class SlowLane:
    """Slots of the step thread's home whose matchers live here (`in`); from the step thread only."""

    def __init__(self, backend: GrammarBackend | None, words: int) -> None:
        self._matchers = MatcherSet(backend, words)  # the lane thread's alone
        self._words = words
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncllm-slow-lane")
        self._last: dict[int, Future[None]] = {}  # slot -> the last work handed for it (earlier work done first)
        # Written by the lane thread, read once the slot's last work is done: its next row (bits, UTF-8 state)
        # and why its request cannot go on; the refusal of its last token.
        self._rows: dict[int, tuple[np.ndarray, int, str | None]] = {}
        self._refused: dict[int, str] = {}
        self._fill: BatchFill | None = None  # xgrammar's one-thread batch fill, made on the lane thread

    def __contains__(self, slot: int) -> bool:
        return slot in self._last

    @property
    def live(self) -> int:
        return len(self._last)

    def add(self, slot: int, spec: StructuredOutput) -> None:
        """A new request's matcher; its first row is filled at once."""
        self._last[slot] = self._pool.submit(self._add, slot, spec)

    def attach(self, slot: int, moved: Moved, bits: np.ndarray, state: int) -> None:
        """A request found slow in the step thread: its matcher (`MatcherSet.detach`) and its next row as the
        step thread filled it (`bits` [words] int32, copied now)."""
        self._last[slot] = self._pool.submit(self._attach, slot, moved, bits.copy(), state)

    def remove(self, slot: int) -> None:
        del self._last[slot]
        self._pool.submit(self._remove, slot)

    def step(self, slots: list[int], tokens: list[int]) -> None:
        """slots[i] accepts tokens[i], then its next row is filled (in the lane, in order)."""
        future = self._pool.submit(self._step, slots, tokens)
        for slot in slots:
            self._last[slot] = future

    def ready(self, slot: int) -> bool:
        """The slot's next row is filled: `take` will not wait."""
        return self._last[slot].done()

    def take(self, slot: int, bits: np.ndarray, states: np.ndarray, row: int) -> str | None:
        """Write the slot's next row into bits[row] and states[row] (waiting for it if need be); why its
        request cannot go on, if it cannot (its row then allows any token: that draw is never output)."""
        self._last[slot].result()
        mask, state, error = self._rows[slot]
        bits[row] = mask
        states[row] = state
        return error

    def refusals(self, slots: list[int]) -> dict[int, str]:
        """Wait for these slots' last tokens: the refused ones' errors by slot."""
        out: dict[int, str] = {}
        for slot in slots:
            self._last[slot].result()
            if slot in self._refused:
                out[slot] = self._refused.pop(slot)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ on the lane's thread
    def _add(self, slot: int, spec: StructuredOutput) -> None:
        self._matchers.add(slot, spec)
        bits, states = self._blank(1)
        errors = self._matchers.fill(bits, states, [0], [slot], self._spread)
        self._rows[slot] = (bits[0], int(states[0]), errors.get(slot))

    def _attach(self, slot: int, moved: Moved, bits: np.ndarray, state: int) -> None:
        self._matchers.attach(slot, moved)  # type: ignore[arg-type]
        self._rows[slot] = (bits, state, None)

    def _remove(self, slot: int) -> None:
        self._matchers.remove(slot)
        self._rows.pop(slot, None)
        self._refused.pop(slot, None)

    def _step(self, slots: list[int], tokens: list[int]) -> None:
        bits, states = self._blank(len(slots))
        refused, errors = self._matchers.step(bits, states, list(range(len(slots))), slots, tokens, self._spread)
        for i, slot in enumerate(slots):
            self._rows[slot] = (bits[i], int(states[i]), errors.get(slot))
        self._refused.update(refused)

    def _blank(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((n, self._words), dtype=np.int32), np.zeros(n, dtype=np.int64)

    def _spread(self, n: int, share: Callable[[BatchFill, int, int], None]) -> None:
        if n:
            if self._fill is None:
                from xgrammar import BatchGrammarMatcher  # loaded by the compile of the grammars it fills for

                self._fill = BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask
            share(self._fill, 0, n)
