"""`RequestGrammar`: a constrained request's handle in the runner: its constraint's field, where its matcher
lives and its slot there, and the error that ends the request. Where matchers live is a `MatcherHome`: the
step thread's own `InlineMatchers` (a `MatcherSet` called in place) or the grammar process
(`grammar_process.py`); the runner's `GrammarTable` asks the same of either, from the step thread, in step
order. Knows nothing of steps' plans or devices: rows and slots are the numbers it is handed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

import numpy as np

from asyncllm.errors import AsyncLLMError
from asyncllm.structured import StructuredOutput
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.draft_fill import accept_runs, fill_after_drafts
from asyncllm.structured_output.fill_costs import FillCosts, TimedRows
from asyncllm.structured_output.host_rows import HostRows
from asyncllm.structured_output.matcher_set import BatchFill, Filler, MatcherSet
from asyncllm.structured_output.slow_lane import SlowLane

if TYPE_CHECKING:
    from asyncllm.sample.state import SamplingState


class MatcherHome(Protocol):
    """Where constrained requests' matchers live. Rows are written by `step` and `fill` no later than
    `collect()` returns; the caller makes sure the rows' last upload has read them first."""

    # Set once the home can serve no more (the grammar process died): its requests end with this error.
    failure: AsyncLLMError | None
    # Its work runs beside the step thread (another process): `step` and `fill` return at once.
    beside: bool

    def add(self, spec: StructuredOutput) -> int:
        """A matcher for `spec` (compiled off this thread); its slot."""
        ...

    def remove(self, slot: int) -> None: ...

    def step(
        self,
        host: HostRows,
        rows: list[int],
        slots: list[int],
        tokens: list[int],
        verdict: bool,
        sampled_next: Collection[int] = (),
        jump: bool = True,
        mark: int = 0,
        leads: list[list[int]] | None = None,
    ) -> None:
        """slots[i] accepts tokens[i], then host row rows[i] is filled for slots[i]. `verdict`: `refusals()`
        will be asked for this step's refusals. `sampled_next`: the slots the step planned after this one
        samples (a jumping slot's row there allows its forced run's first token alone). `jump`: False takes
        no new forced run this step (every slot's next token is drawn). `mark`: then `mark(host, mark)`.
        `leads`: slots[i] accepts leads[i] first (a verified step's accepted tokens before its last)."""
        ...

    def drafts(
        self, host: HostRows, rows: list[list[int]], slots: list[int], drafts: list[list[int]], jumps: list[bool]
    ) -> dict[int, int]:
        """Host rows rows[i][j] filled for slots[i] after drafts[i][: j + 1] (`draft_fill.fill_after_drafts`;
        the matcher then stands where it stood). The most drafts position i may accept, where jumps[i] and
        its grammar forces text after one (jump-forward)."""
        ...

    def forced(self) -> dict[int, list[int]]:
        """The last `step`'s forced runs (jump-forward) by slot: tokens each slot took after its own."""
        ...

    def refusals(self) -> dict[int, str]:
        """The last `step`'s refused tokens' errors by slot: all of them when it was asked for a verdict
        (waiting for them), else those known already (the rest come with `collect`)."""
        ...

    def fill(self, host: HostRows, rows: list[int], slots: list[int]) -> None:
        """Host row rows[i] filled for slots[i]."""
        ...

    def collect(self, upto: int | None = None) -> dict[int, str]:
        """Once every row asked for is written (`upto`: by the messages up to that `last_seq`): the errors of
        the slots filled since the last call."""
        ...

    @property
    def last_seq(self) -> int:
        """A home beside the step thread: the number of the last message sent to it (0 for the step thread's)."""
        ...

    def mark(self, host: HostRows, mark: int) -> None:
        """Set this home's flag of `host` to `mark` once every row asked for is written (the device waits on
        it: `stream_wait.py`): a home beside the step thread when it gets there, the step thread's now."""
        ...

    def close(self) -> None: ...


class RequestGrammar:
    """One constrained request's handle: `home` holds its matcher at `slot`. `error` (set by the table from
    what the home reports) ends the request; `removed` once the request is gone (a step in flight may still
    name it: the home is not asked about it again, so its slot may serve another request)."""

    __slots__ = ("deferred", "error", "field", "home", "jumps", "removed", "slot", "state")

    def __init__(
        self, field: str, home: MatcherHome, slot: int, jumps: bool = False, state: SamplingState | None = None
    ) -> None:
        self.field = field
        self.home = home
        self.slot = slot
        # Its forced text is output without draws (jump-forward); `state` (the request's sampling state) then
        # gives back a draw's noise offset when that draw only repeats a forced token (`FillJob`).
        self.jumps = jumps
        self.state = state
        self.error: str | AsyncLLMError | None = None
        self.removed = False
        self.deferred = False  # its last draw was deferred (its row in the slow lane was not ready: `deferral.py`)


class InlineMatchers:
    """The step thread's home: a `MatcherSet` called in place (the grammar process's twin). Its fill takes
    xgrammar's own threads for a step's many rows (`Filler`). With `costs`, each request's accepts and fills
    are timed: one found slow moves to the slow lane (`slow_lane.py`, a thread beside this one), and so do
    later requests with its constraint; the lane's rows are written by `take_lane_row`."""

    failure: AsyncLLMError | None = None
    beside = False

    def __init__(self, backend: GrammarBackend | None, words: int, costs: FillCosts | None = None) -> None:
        self.matchers = MatcherSet(backend, words)
        self.flags: np.ndarray | None = None  # its flag of each set of rows, where a device waits on them
        self._free: list[int] = []
        self._next_slot = 0
        self._refused: dict[int, str] = {}
        self._errors: dict[int, str] = {}
        self._filler: BatchFill | None = None
        self.costs = costs if costs is not None and costs.bound_s is not None else None
        self.lane: SlowLane | None = None
        self._backend, self._words = backend, words
        self._specs: dict[int, StructuredOutput] = {}  # slot -> its constraint, while costs are watched
        self._found_slow: set[int] = set()  # slots found slow by their drafted rows, to move to the lane
        if self.costs is not None:
            self.matchers.timer = TimedRows()

    def add(self, spec: StructuredOutput, jump: bool = False) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        if self.costs is None:
            self.matchers.add(slot, spec, jump)
            return slot
        self._specs[slot] = spec
        if self.costs.is_slow(spec):
            self._lane().add(slot, spec)
        else:
            self.matchers.add(slot, spec, jump)
        return slot

    def in_lane(self, slot: int) -> bool:
        return self.lane is not None and slot in self.lane

    def remove(self, slot: int) -> None:
        if self.in_lane(slot):
            assert self.lane is not None
            self.lane.remove(slot)
        else:
            self.matchers.remove(slot)
        if self.costs is not None:
            self.costs.forget(slot)
            self._specs.pop(slot, None)
            self._found_slow.discard(slot)
        self._errors.pop(slot, None)  # the slot may serve another request before the next collect
        self._refused.pop(slot, None)
        self._free.append(slot)

    def step(
        self,
        host: HostRows,
        rows: list[int],
        slots: list[int],
        tokens: list[int],
        verdict: bool,
        sampled_next: Collection[int] = (),
        jump: bool = True,
        mark: int = 0,
        leads: list[list[int]] | None = None,
    ) -> None:
        refused: dict[int, str] = {}
        if self.lane is not None and self.lane.live:
            rows, slots, tokens, leads, refused = self._to_lane(rows, slots, tokens, verdict, leads)
        matchers = self.matchers
        if leads:
            refused.update(accept_runs(matchers, slots, leads))
        self._refused, errors = matchers.step(
            host.bits_np, host.states_np, rows, slots, tokens, self._spread, sampled_next, jump
        )
        self._refused.update(refused)
        self._errors.update(errors)
        if self.costs is not None:
            self._watch(host, rows, slots)
        if mark:
            self.mark(host, mark)

    def forced(self) -> dict[int, list[int]]:
        return self.matchers.forced

    def refusals(self) -> dict[int, str]:
        refused, self._refused = self._refused, {}
        return refused

    def fill(self, host: HostRows, rows: list[int], slots: list[int]) -> None:
        if self.lane is not None and self.lane.live:  # the table takes the lane's rows first: here for safety
            for row, slot in zip(rows, slots):
                if slot in self.lane and (error := self.take_lane_row(host, row, slot)) is not None:
                    self._errors[slot] = error
            kept = [(row, slot) for row, slot in zip(rows, slots) if slot not in self.lane]
            rows, slots = [row for row, _ in kept], [slot for _, slot in kept]
        self._errors.update(self.matchers.fill(host.bits_np, host.states_np, rows, slots, self._spread))
        if self.costs is not None:
            self._watch(host, rows, slots)

    def drafts(
        self, host: HostRows, rows: list[list[int]], slots: list[int], drafts: list[list[int]], jumps: list[bool]
    ) -> dict[int, int]:
        caps: dict[int, int] = {}
        clock = time.thread_time
        for i, (own, slot, tokens, jump) in enumerate(zip(rows, slots, drafts, jumps)):
            assert not self.in_lane(slot), "the lane's drafted rows are its own (`SlowLane.draft`)"
            start = clock()
            cap = fill_after_drafts(self.matchers, host.bits_np, host.states_np, slot, own, tokens, jump)
            if cap is not None:
                caps[i] = cap
            if self.costs is not None and self.costs.observe([slot], [(clock() - start) / len(own)]):
                self._found_slow.add(slot)  # a row's cost, as its own rows': it moves when its next row is filled
        return caps

    def take_lane_row(self, host: HostRows, row: int, slot: int) -> str | None:
        """Host row `row` is the lane slot's next row (waited for if need be); why its request cannot go on."""
        assert self.lane is not None
        return self.lane.take(slot, host.bits_np, host.states_np, row)

    def _to_lane(
        self, rows: list[int], slots: list[int], tokens: list[int], verdict: bool, leads: list[list[int]] | None
    ) -> tuple[list[int], list[int], list[int], list[list[int]] | None, dict[int, str]]:
        """Hand the lane its slots' tokens (and leads); the rest of (rows, slots, tokens, leads), and the lane's
        refusals where a verdict is asked for one of them (its row allowed nothing: it drew token 0)."""
        lane = self.lane
        assert lane is not None
        mine = [i for i, slot in enumerate(slots) if slot in lane]
        if not mine:
            return rows, slots, tokens, leads, {}
        lane.step([slots[i] for i in mine], [tokens[i] for i in mine], [leads[i] for i in mine] if leads else None)
        zeros = [slots[i] for i in mine if tokens[i] == 0] if verdict else []
        refused = lane.refusals(zeros) if zeros else {}
        rest = [i for i in range(len(slots)) if slots[i] not in lane]
        kept = [leads[i] for i in rest] if leads else None
        return [rows[i] for i in rest], [slots[i] for i in rest], [tokens[i] for i in rest], kept, refused

    def _watch(self, host: HostRows, rows: list[int], slots: list[int]) -> None:
        """Fold the rows just timed into their requests' costs; move those that turned slow to the lane,
        with the row just filled for them (a jumping one stays), and remember their constraints."""
        assert self.costs is not None and self.matchers.timer is not None
        timed, seconds = self.matchers.timer.take()
        slow = set(self.costs.observe(timed, seconds)) | self._found_slow
        if not slow:
            return
        row_of = dict(zip(slots, rows))
        for slot in slow:
            self.costs.mark_slow(self._specs[slot])
            if slot not in row_of:  # found slow filling its drafted rows: moved with its next row
                continue
            self._found_slow.discard(slot)
            moved = self.matchers.detach(slot)
            if moved is not None:
                row = row_of[slot]
                self._lane().attach(slot, moved, host.bits_np[row], int(host.states_np[row]))

    def _lane(self) -> SlowLane:
        if self.lane is None:
            self.lane = SlowLane(self._backend, self._words)
        return self.lane

    def collect(self, upto: int | None = None) -> dict[int, str]:
        errors, self._errors = self._errors, {}
        return errors

    last_seq = 0

    def mark(self, host: HostRows, mark: int) -> None:
        assert self.flags is not None, "no device waits on this home's rows"
        self.flags[host.index] = mark  # its rows are written: `step` and `fill` return once they are

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()

    def _spread(self, n: int, share: Callable[[BatchFill, int, int], None]) -> None:
        """One part, here: xgrammar's own threads split a many-row fill (`Filler`)."""
        if n:
            if self._filler is None:
                self._filler = Filler()  # made at the first matcher's fill: xgrammar is loaded by then
            share(self._filler, 0, n)
