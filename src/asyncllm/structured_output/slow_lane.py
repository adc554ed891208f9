"""`SlowLane`: the matchers of constrained requests that are slow to follow (`fill_costs.py`), on a thread of
their own beside the step thread, so that their work costs their own requests, not the step every request
shares. The step thread hands the lane a request's token once it is known (`step`: accepted there, and the
next bitmask row filled into the lane's own copy) and takes the row when the request's next draw is due
(`take`), if it is `ready`. A request whose row is not ready sits that draw out (`deferral.py`): its token is
drawn in a later step, and the core plans it again (`ModelRunnerOutput.deferred`).

xgrammar releases the GIL while it accepts and fills, so the lane's work runs beside the step thread's. One
thread runs the lane's work in the order handed: a slot's matcher is only ever touched there, and a slot
reused for another request finds the previous one's work done first. The lane remembers where the first
tokens of its constraints lead (`SEEN_PATHS`): a request whose output so far is one seen before takes a copy
of that matcher and its row (xgrammar's `fork`, ~1 ms at a 20,000-string enum's widest state, against 4-10 ms
to accept and fill there), so many requests with one slow constraint cost about what one costs. Speculative
decoding: a step's accepted tokens before its last come with it (`step`'s `leads`), and a request's drafted
rows are filled in the lane too (`draft`), handed back as a future the step takes only if done by its draw.
Knows nothing of steps' plans or devices.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from asyncllm.structured import StructuredOutput
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.draft_fill import accept_runs, fill_after_drafts
from asyncllm.structured_output.matcher_set import BatchFill, MatcherSet

Moved = tuple[object, int, str]  # `MatcherSet.detach`'s: the matcher, its UTF-8 state, its field

# The lane thread's nice value (Linux sets it per thread): its work yields the CPU to every other thread of
# the host, the step thread's and the server's included. A slow constraint's requests wait for the cores the
# others leave, rather than taking them from the others (their deadlines still bound them).
LANE_NICE = 19

# Outputs remembered (constraint, tokens so far -> matcher and row), least recently used out first; only the
# first `SEEN_TOKENS` tokens of an output, where requests with one constraint meet most.
SEEN_PATHS = 128
SEEN_TOKENS = 8

Path = tuple[StructuredOutput, tuple[int, ...]]
DraftRows = tuple[np.ndarray, np.ndarray]  # a request's drafted rows: bits [k, words] int32, states [k] int64


class SlowLane:
    """Slots of the step thread's home whose matchers live here (`in`); from the step thread only."""

    def __init__(self, backend: GrammarBackend | None, words: int) -> None:
        self._matchers = MatcherSet(backend, words)  # the lane thread's alone
        self._words = words
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncllm-slow-lane", initializer=_yield_cpu)
        self._last: dict[int, Future[None]] = {}  # slot -> the last work handed for it (earlier work done first)
        # Written by the lane thread, read once the slot's last work is done: its next row (bits, UTF-8 state)
        # and why its request cannot go on; the refusal of its last token.
        self._rows: dict[int, tuple[np.ndarray, int, str | None]] = {}
        self._refused: dict[int, str] = {}
        self._fill: BatchFill | None = None  # xgrammar's one-thread batch fill, made on the lane thread
        # The lane thread's: each slot's constraint and output so far (None: not remembered, e.g. attached),
        # and the paths seen (a matcher there, never advanced: forked for each request that gets there).
        self._paths: dict[int, Path | None] = {}
        self._seen: OrderedDict[Path, tuple[Any, np.ndarray, int]] = OrderedDict()

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

    def step(self, slots: list[int], tokens: list[int], leads: list[list[int]] | None = None) -> None:
        """slots[i] accepts leads[i] (a verified step's accepted tokens before its last), then tokens[i], then its
        next row is filled (in the lane, in order)."""
        future = self._pool.submit(self._step, slots, tokens, leads or [[] for _ in slots])
        for slot in slots:
            self._last[slot] = future

    def draft(self, slot: int, drafts: list[int]) -> Future[DraftRows]:
        """The slot's rows after each of `drafts` (`fill_after_drafts`), filled in the lane after the work handed
        so far (its matcher then stands where it stood). Not the slot's next row: `ready` and `take` ignore it."""
        return self._pool.submit(self._draft, slot, drafts)

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
        path: Path = (spec, ())
        self._paths[slot] = path
        if self._reuse(slot, path, spec.field):
            return
        self._matchers.add(slot, spec)
        bits, states = self._blank(1)
        errors = self._matchers.fill(bits, states, [0], [slot], self._spread)
        self._rows[slot] = (bits[0], int(states[0]), errors.get(slot))
        self._remember(slot)

    def _attach(self, slot: int, moved: Moved, bits: np.ndarray, state: int) -> None:
        self._matchers.attach(slot, moved)  # type: ignore[arg-type]
        self._rows[slot] = (bits, state, None)
        self._paths[slot] = None  # its output so far is the step thread's: not remembered

    def _remove(self, slot: int) -> None:
        self._matchers.remove(slot)
        self._rows.pop(slot, None)
        self._refused.pop(slot, None)
        self._paths.pop(slot, None)

    def _step(self, slots: list[int], tokens: list[int], leads: list[list[int]]) -> None:
        todo: list[int] = []
        for i, (slot, token) in enumerate(zip(slots, tokens)):
            path = self._paths.get(slot)
            more = (*path[1], *leads[i], token) if path else ()
            path = self._paths[slot] = (path[0], more) if path and len(more) <= SEEN_TOKENS else None
            if path is None or not self._reuse(slot, path, path[0].field):
                todo.append(i)
        if not todo:
            return
        slots, tokens = [slots[i] for i in todo], [tokens[i] for i in todo]
        refused = accept_runs(self._matchers, slots, [leads[i] for i in todo])
        bits, states = self._blank(len(slots))
        stepped, errors = self._matchers.step(bits, states, list(range(len(slots))), slots, tokens, self._spread)
        refused.update(stepped)
        for i, slot in enumerate(slots):
            self._rows[slot] = (bits[i], int(states[i]), errors.get(slot))
            if slot not in refused and slot not in errors:
                self._remember(slot)
        self._refused.update(refused)

    def _draft(self, slot: int, drafts: list[int]) -> DraftRows:
        bits, states = self._blank(len(drafts))
        fill_after_drafts(self._matchers, bits, states, slot, range(len(drafts)), drafts)  # the lane never jumps
        return bits, states

    def _reuse(self, slot: int, path: Path, field: str) -> bool:
        """Give `slot` the matcher and row of `path`, if seen: True; else False (nothing changed)."""
        seen = self._seen.get(path)
        if seen is None:
            return False
        self._seen.move_to_end(path)
        matcher, bits, state = seen
        self._matchers.detach(slot)  # its own matcher, one token behind, if it has one
        self._matchers.attach(slot, (matcher.fork(), state, field))
        self._rows[slot] = (bits, state, None)
        return True

    def _remember(self, slot: int) -> None:
        """Keep where `slot`'s output stands (a copy of its matcher, never advanced, and its row), unless its
        matcher ended or is not to be remembered."""
        path = self._paths.get(slot)
        moved = self._matchers.detach(slot) if path is not None else None
        if path is None or moved is None:
            return
        self._matchers.attach(slot, moved)
        matcher, state, _ = moved
        self._seen[path] = (matcher.fork(), self._rows[slot][0], state)
        self._seen.move_to_end(path)
        if len(self._seen) > SEEN_PATHS:
            self._seen.popitem(last=False)

    def _blank(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((n, self._words), dtype=np.int32), np.zeros(n, dtype=np.int64)

    def _spread(self, n: int, share: Callable[[BatchFill, int, int], None]) -> None:
        if n:
            if self._fill is None:
                from xgrammar import BatchGrammarMatcher  # loaded by the compile of the grammars it fills for

                self._fill = BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask
            share(self._fill, 0, n)


def _yield_cpu() -> None:
    """Run by the lane's thread first: its nice value, where the OS sets one per thread (else as it was)."""
    with contextlib.suppress(AttributeError, OSError):  # no setpriority, or not a per-thread one
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LANE_NICE)
