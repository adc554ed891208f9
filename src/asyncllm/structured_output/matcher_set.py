"""`MatcherSet`: constrained requests' xgrammar matchers by slot, with where each output stands within a
UTF-8 character, and the two things a step asks of them: `accept` its sampled tokens, `fill` the next
bitmask rows. The same code runs in the step thread (the in-thread twin) and in the grammar process
(`grammar_worker.py`). Per-slot state lives in numpy arrays, so a step costs a few array operations and one
xgrammar call each way rather than Python per row (every xgrammar call releases the GIL). Knows nothing of
steps, devices, processes or threads: slots are the caller's small integers, rows index the caller's arrays.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, cast

import numpy as np

from asyncllm.errors import InvalidRequestError
from asyncllm.structured import StructuredOutput
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.fill_costs import TIMED_MAX_ROWS, TimedRows
from asyncllm.structured_output.jump_forward import ForcedTokens
from asyncllm.structured_output.utf8 import BOUNDARY, Utf8Table

if TYPE_CHECKING:
    import xgrammar as xgr

# Fills bitmask rows `indices` of `bitmask` [rows, words] with the matchers' next masks (xgrammar's batch fill).
BatchFill = Callable[[list["xgr.GrammarMatcher"], np.ndarray, list[int]], None]

# `spread(n, share)` runs share(batch_fill, lo, hi) over [0, n) in parts (perhaps on threads of its own, each
# with its own `batch_fill`); it returns once every part has.
Spread = Callable[[int, Callable[[BatchFill, int, int], None]], None]

# xgrammar starts its threads anew on every batch call (0.1-1 ms): fewer rows than this are filled on one.
PARALLEL_MIN_ROWS = 16


# A many-row fill's threads at most: on the H200's 16-core host 256 rows of W6's schema filled in 5.1 ms on
# one thread, 2.1 on 4, 1.49 on 8, 1.69 on 14 and 1.89 on 16 (bench/w6_host.py, bench/RESULTS.md run 73).
MAX_FILL_THREADS = 8


class Filler:
    """xgrammar's batch fill, its thread count chosen per call: fewer than `PARALLEL_MIN_ROWS` rows on one
    thread, more on up to `MAX_FILL_THREADS` of the host's cores (the step thread and the device's driver keep
    two)."""

    def __init__(self, threads: int | None = None) -> None:
        """`threads`: the many-row fill's (None: the host's cores less two, at most `MAX_FILL_THREADS`)."""
        from xgrammar import BatchGrammarMatcher  # loaded by the compile of the grammars it fills for

        self._one = BatchGrammarMatcher(max_threads=1)
        cores = len(os.sched_getaffinity(0))
        many = threads if threads is not None else max(1, min(MAX_FILL_THREADS, cores - 2))
        self._many = BatchGrammarMatcher(max_threads=many)

    def __call__(self, matchers: list[xgr.GrammarMatcher], bitmask: np.ndarray, indices: list[int]) -> None:
        batch = self._many if len(matchers) >= PARALLEL_MIN_ROWS else self._one
        batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)


class MatcherSet:
    """`add(slot, spec)` / `remove(slot)`; per step `step(...)` (`accept` then `fill`), or either alone. A
    slot's matcher is made when its compile is first needed (`resolve`); a slot whose constraint failed to
    compile, or whose token was refused, keeps its error (`errors`), and its rows allow any token from then
    on (its request ends; its tokens are never output). The parts a call hands to `spread` may run on
    parallel threads: each touches only its own rows and matchers."""

    def __init__(self, backend: GrammarBackend | None, words: int) -> None:
        self.backend = backend
        self.stop_row = np.zeros(words, dtype=np.int32)  # the stop tokens alone, as a bitmask row
        self._is_stop = np.zeros(backend.vocab_size if backend is not None else 0, dtype=bool)
        for token in backend.stop_token_ids if backend is not None else ():
            self.stop_row[token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))
            self._is_stop[token] = True
        self.errors: dict[int, str] = {}  # slot -> why its request cannot go on
        self._utf8: Utf8Table | None = None
        self._state = np.zeros(0, dtype=np.int8)  # where each output stands within a character
        self._terminated = np.zeros(0, dtype=bool)  # its matcher accepted a stop token
        self._ready = np.zeros(0, dtype=bool)  # its matcher is made and it has no error
        self._jumps = np.zeros(0, dtype=bool)  # its forced text is output without draws (jump-forward)
        # Its next token (the first of a forced run, the only one its row allows) was accepted with the run.
        self._drawn_ahead = np.zeros(0, dtype=bool)
        self._forced_tokens: ForcedTokens | None = None
        self.forced: dict[int, list[int]] = {}  # the last `step`'s forced runs by slot (jump-forward)
        self._matchers: list[xgr.GrammarMatcher | None] = []
        self._futures: list[Future[xgr.CompiledGrammar] | None] = []
        self._fields: list[str] = []
        self._pending: set[int] = set()  # slots whose compile has not been resolved
        # Set by a home that watches its requests' costs (`fill_costs.py`): each row's accept and fill timed.
        self.timer: TimedRows | None = None

    def add(self, slot: int, spec: StructuredOutput, jump: bool = False) -> None:
        """`jump`: the slot's forced text is output without draws (`step`); needs the backend's tokenizer."""
        if slot >= len(self._matchers):
            self._grow(slot + 1)
        self._state[slot], self._terminated[slot], self._ready[slot] = BOUNDARY, False, False
        jump = jump and self.backend is not None and self.backend.tokenizer is not None
        self._jumps[slot], self._drawn_ahead[slot] = jump, False
        self._matchers[slot], self._fields[slot] = None, spec.field
        self.errors.pop(slot, None)
        if self.backend is None:
            self._futures[slot] = None
            self.errors[slot] = (
                f"SamplingParams.{spec.field} needs the model's tokenizer and EOS ids, and this engine lacks them"
            )
        else:
            self._futures[slot] = self.backend.compile_async(spec)
            self._pending.add(slot)

    def remove(self, slot: int) -> None:
        self._matchers[slot] = self._futures[slot] = None
        self._ready[slot] = self._jumps[slot] = self._drawn_ahead[slot] = False
        self._pending.discard(slot)
        self.errors.pop(slot, None)

    def detach(self, slot: int) -> tuple[xgr.GrammarMatcher, int, str] | None:
        """Give up `slot` (its matcher made, not terminated, not jumping, no error) for another set to `attach`:
        its matcher, where its output stands within a character, its field. None (nothing changed) otherwise."""
        matcher = self._matchers[slot]
        if matcher is None or not self._ready[slot] or self._jumps[slot] or self._terminated[slot]:
            return None
        moved = (matcher, int(self._state[slot]), self._fields[slot])
        self.remove(slot)
        return moved

    def attach(self, slot: int, moved: tuple[xgr.GrammarMatcher, int, str]) -> None:
        """Take a slot another set gave up (`detach`), as it stood there."""
        if slot >= len(self._matchers):
            self._grow(slot + 1)
        self._matchers[slot], self._state[slot], self._fields[slot] = moved
        self._terminated[slot] = self._jumps[slot] = self._drawn_ahead[slot] = False
        self._ready[slot], self._futures[slot] = True, None
        self.errors.pop(slot, None)
        if self.backend is not None:
            self._utf8 = self.backend.utf8

    def cursor(self, slot: int) -> tuple[xgr.GrammarMatcher, int] | None:
        """A made, unfailed, unterminated slot's matcher and UTF-8 state, for drafts (`draft_rows.py`)."""
        matcher = self._matchers[slot]
        if matcher is None or not self._ready[slot] or self._terminated[slot]:
            return None
        return matcher, int(self._state[slot])

    def resolve(self, slots: Sequence[int]) -> None:
        """Make the matchers of `slots` whose compile was pending (waiting for it)."""
        if not self._pending:
            return
        for slot in self._pending.intersection(slots):
            self._pending.discard(slot)
            future = self._futures[slot]
            assert future is not None and self.backend is not None
            from xgrammar import GrammarMatcher  # loaded by the compile that produced the future

            try:
                self._matchers[slot] = GrammarMatcher(future.result())
            except InvalidRequestError as exc:  # a request that reached the core without the front's check
                self.errors[slot] = str(exc)
                continue
            finally:
                self._futures[slot] = None
            self._utf8 = self.backend.utf8  # built before any compile finished
            self._ready[slot] = True

    def accept(self, slots: Sequence[int], tokens: Sequence[int]) -> dict[int, str]:
        """Feed each slot its token, in one xgrammar call; the refusals' errors by slot (the matcher, or the
        UTF-8 table, refused the token: the request ends with it). A slot that terminated or failed drops its
        token (its request has ended)."""
        self.resolve(slots)
        s, t = np.asarray(slots, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
        go, after, refused = self._screen(s, t)
        idx = np.flatnonzero(go)
        ok: list[bool] = []
        if len(idx):
            from xgrammar import BatchGrammarMatcher  # loaded by the compile that made the matchers

            ok = BatchGrammarMatcher.batch_accept_token([self._matchers[k] for k in s[idx].tolist()], t[idx].tolist())
        self._advance(s, t, after, idx, np.asarray(ok, dtype=bool), refused)
        return refused

    def fill(
        self, bits: np.ndarray, states: np.ndarray, rows: Sequence[int], slots: Sequence[int], spread: Spread
    ) -> dict[int, str]:
        """Row rows[i] of `bits` and `states` for slots[i]: its next mask and UTF-8 state; every row of a slot
        with an error allows any token, a terminated one's the stop tokens alone. The errors of those slots."""
        self.resolve(slots)
        s, r = np.asarray(slots, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        idx = np.flatnonzero(self._ready[s] & ~self._terminated[s])

        def share(batch_fill: BatchFill, lo: int, hi: int) -> None:
            self._fill_rows(batch_fill, s[idx[lo:hi]].tolist(), bits, r[idx[lo:hi]].tolist())

        spread(len(idx), share)
        return self._finish_rows(bits, states, s, r)

    def _fill_rows(self, batch_fill: BatchFill, slots: list[int], bits: np.ndarray, rows: list[int]) -> None:
        """bits[rows[i]] is slot slots[i]'s next mask (each timed where a `timer` watches)."""
        matchers = self._made(slots)
        if self.timer is None:
            batch_fill(matchers, bits, rows)
        else:
            self.timer.fill(batch_fill, matchers, slots, bits, rows)

    def step(
        self,
        bits: np.ndarray,
        states: np.ndarray,
        rows: Sequence[int],
        slots: Sequence[int],
        tokens: Sequence[int],
        spread: Spread,
        sampled_next: Collection[int] = (),
        jump: bool = True,
    ) -> tuple[dict[int, str], dict[int, str]]:
        """`accept` then `fill` for the same slots, each share of the rows (`spread`) accepting then filling
        its own in two xgrammar calls; (refusals, errors) by slot. Where a slot jumps forward, `forced` says
        which tokens it took after its own; `sampled_next`: the slots the step planned after this one samples
        (their row allows the run's first token alone: that draw is already under way); `jump`: False takes no
        new run this step (a slot drawn ahead by the last one is still settled)."""
        self.resolve(slots)
        s, t, r = (np.asarray(a, dtype=np.int64) for a in (slots, tokens, rows))
        if self.forced:
            self.forced = {}
        if self._jumps[s].any():
            return self._step_jumping(bits, states, s, t, r, spread, sampled_next, jump)
        go, after, refused = self._screen(s, t)
        idx = np.flatnonzero(go)
        ends = self._is_stop[t[idx]]  # those rows terminate with their token: nothing to fill after it
        ok = np.ones(len(idx), dtype=bool)

        def share(batch_fill: BatchFill, lo: int, hi: int) -> None:
            from xgrammar import BatchGrammarMatcher  # loaded by the compile that made the matchers

            part = idx[lo:hi]
            slots = s[part].tolist()
            matchers = self._made(slots)
            timer = self.timer
            if timer is not None and len(part) <= TIMED_MAX_ROWS:
                rows = r[part].tolist()
                ok[lo:hi] = timer.accept_and_fill(matchers, slots, t[part].tolist(), ends[lo:hi].tolist(), bits, rows)
                return
            start = time.perf_counter()
            took = np.asarray(BatchGrammarMatcher.batch_accept_token(matchers, t[part].tolist()), dtype=bool)
            ok[lo:hi] = took
            more = took & ~ends[lo:hi]
            if more.any():
                batch_fill([m for m, fill in zip(matchers, more.tolist()) if fill], bits, r[part[more]].tolist())
            if timer is not None:
                timer.spread(slots, time.perf_counter() - start)

        spread(len(idx), share)
        self._advance(s, t, after, idx, ok, refused)
        return refused, self._finish_rows(bits, states, s, r)

    def _step_jumping(
        self,
        bits: np.ndarray,
        states: np.ndarray,
        s: np.ndarray,
        t: np.ndarray,
        r: np.ndarray,
        spread: Spread,
        sampled_next: Collection[int],
        jump: bool,
    ) -> tuple[dict[int, str], dict[int, str]]:
        """`step` where some slot jumps forward: accept (one xgrammar call), take each jumping slot's forced
        run, then fill every row still owed a mask. A slot drawn ahead skips its accept (its token came with
        its run); a slot whose run's first token the next step draws gets a row allowing that token alone."""
        ahead = self._drawn_ahead[s] & self._ready[s] & ~self._terminated[s]
        self._drawn_ahead[s] = False
        go, after, refused = self._screen(s, t, ~ahead)
        idx = np.flatnonzero(go)
        ok = np.ones(len(idx), dtype=bool)
        if len(idx):
            from xgrammar import BatchGrammarMatcher  # loaded by the compile that made the matchers

            slots, tokens = s[idx].tolist(), t[idx].tolist()
            matchers = self._made(slots)
            if self.timer is not None:
                ok = np.asarray(self.timer.accept(matchers, slots, tokens), dtype=bool)
            else:
                ok = np.asarray(BatchGrammarMatcher.batch_accept_token(matchers, tokens), dtype=bool)
        self._advance(s, t, after, idx, ok, refused)
        taken = idx[ok]
        jumping = taken[self._jumps[s[taken]] & ~self._terminated[s[taken]]] if jump else taken[:0]
        pinned: list[tuple[int, int, int]] = []  # (position, the run's first token, the UTF-8 state before it)
        if len(jumping):
            forced = self.forced_tokens()
            for pos in jumping.tolist():
                slot = int(s[pos])
                matcher = self._matchers[slot]
                assert matcher is not None
                before = int(self._state[slot])
                run, self._state[slot] = forced.run(matcher, before)
                if run:
                    self.forced[slot] = run
                    if slot in sampled_next:
                        pinned.append((pos, run[0], before))
                        self._drawn_ahead[slot] = True
        fill = self._ready[s] & ~self._terminated[s]
        for pos, _, _ in pinned:
            fill[pos] = False
        part_idx = np.flatnonzero(fill)

        def share(batch_fill: BatchFill, lo: int, hi: int) -> None:
            self._fill_rows(batch_fill, s[part_idx[lo:hi]].tolist(), bits, r[part_idx[lo:hi]].tolist())

        spread(len(part_idx), share)
        errors = self._finish_rows(bits, states, s, r)
        for pos, token, before in pinned:
            row = r[pos]
            bits[row] = 0
            bits[row, token >> 5] = np.uint32(1 << (token & 31)).view(np.int32)
            states[row] = before
        return refused, errors

    def _made(self, slots: list[int]) -> list[xgr.GrammarMatcher]:
        """The matchers of `slots`, each made (ready): no None among them."""
        return cast("list[xgr.GrammarMatcher]", [self._matchers[k] for k in slots])

    def forced_tokens(self) -> ForcedTokens:
        if self._forced_tokens is None:
            assert self.backend is not None and self._utf8 is not None
            self._forced_tokens = ForcedTokens(self.backend.tokenizer, self._utf8, self._is_stop)
        return self._forced_tokens

    def _screen(
        self, s: np.ndarray, t: np.ndarray, eligible: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
        """Which positions' tokens go to their matchers (ready, not terminated, valid UTF-8 there; among
        `eligible`), the UTF-8 state after each token, and the refusals already known (invalid UTF-8)."""
        go = self._ready[s] & ~self._terminated[s]
        if eligible is not None:
            go &= eligible
        after = np.zeros(len(s), dtype=np.int8)
        refused: dict[int, str] = {}
        if go.any():
            assert self._utf8 is not None
            after[go] = self._utf8.next[self._state[s[go]], t[go]]  # -1: not valid UTF-8 there
            bad = go & (after < 0)
            if bad.any():
                refused.update((k, self._refuse(k, x)) for k, x in zip(s[bad].tolist(), t[bad].tolist()))
                go &= ~bad
        return go, after, refused

    def _advance(
        self, s: np.ndarray, t: np.ndarray, after: np.ndarray, idx: np.ndarray, ok: np.ndarray, refused: dict[int, str]
    ) -> None:
        """Positions `idx` went to their matchers, `ok` where taken: advance those, refuse the others."""
        if not ok.all():
            refused.update((k, self._refuse(k, x)) for k, x in zip(s[idx[~ok]].tolist(), t[idx[~ok]].tolist()))
        took = idx[ok]
        self._state[s[took]] = after[took]
        self._terminated[s[took]] = self._is_stop[t[took]]  # the matcher accepted a stop token: it has terminated

    def _finish_rows(self, bits: np.ndarray, states: np.ndarray, s: np.ndarray, r: np.ndarray) -> dict[int, str]:
        """The rows no matcher fills, and every row's state; the errors of slots `s`."""
        states[r] = self._state[s]
        ready = self._ready[s]
        errors: dict[int, str] = {}
        if not ready.all():
            bits[r[~ready]] = -1  # any token: a failed request's is never output
            errors = {k: self.errors[k] for k in s[~ready].tolist()}
        done = ready & self._terminated[s]
        if done.any():
            bits[r[done]] = self.stop_row  # complete: EOS alone (its request has ended; the token is dropped)
        return errors

    def _refuse(self, slot: int, token_id: int) -> str:
        """Fail `slot` for `token_id`, which its matcher (or UTF-8) refused: say why. The matcher is still where
        the draw found it: either its row allowed nothing (the draw then takes token 0), or this is a bug."""
        matcher, utf8 = self._matchers[slot], self._utf8
        assert matcher is not None and utf8 is not None
        row = np.zeros(utf8.allowed.shape[1], dtype=np.int32)
        matcher.fill_next_token_bitmask(row)
        field = self._fields[slot]
        if not (row & utf8.allowed[self._state[slot]]).any():
            error = (
                f"SamplingParams.{field}: no token of the model's vocabulary can continue the output here "
                "(the constraint asks for text the vocabulary cannot spell as valid UTF-8, or allows none)"
            )
        else:
            error = f"SamplingParams.{field}: token {token_id} was sampled against the constraint (a bug)"
        self.errors[slot] = error
        self._ready[slot] = False
        return error

    def _grow(self, size: int) -> None:
        size = max(size, 2 * len(self._matchers), 64)
        extra = size - len(self._matchers)
        self._state = np.concatenate([self._state, np.zeros(extra, dtype=np.int8)])
        self._terminated = np.concatenate([self._terminated, np.zeros(extra, dtype=bool)])
        self._ready = np.concatenate([self._ready, np.zeros(extra, dtype=bool)])
        self._jumps = np.concatenate([self._jumps, np.zeros(extra, dtype=bool)])
        self._drawn_ahead = np.concatenate([self._drawn_ahead, np.zeros(extra, dtype=bool)])
        self._matchers += [None] * extra
        self._futures += [None] * extra
        self._fields += [""] * extra
