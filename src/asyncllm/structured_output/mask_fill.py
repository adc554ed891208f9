"""The masks of constrained rows, filled ahead: when a constrained step's tokens are read on the host (by the
core, before it turns them into outputs: `GrammarTable.advance`), its `FillJob` hands them to the requests'
matcher homes, which accept them and fill each request's next bitmask row, so the next step's draw finds its
rows ready. The grammar process's share is only sent here (it runs beside the step thread's own work, and the
draw waits for it; a helper thread of the engine's process would contend for the GIL); the step thread's own
share (`InlineMatchers`) is done here, in one xgrammar call each way. `DeviceMasks` uploads the rows and ANDs
each with its UTF-8 table row on the device. Knows nothing of models or scheduling: rows are numbered by
whoever plans the step.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from asyncllm.errors import AsyncLLMError
from asyncllm.step import ModelRunnerOutput, StepResult
from asyncllm.structured_output.host_rows import HostRows
from asyncllm.structured_output.request_grammar import MatcherHome, RequestGrammar
from asyncllm.structured_output.slow_lane import DraftRows

# Jump-forward takes forced runs only after steps that sampled at most this many rows. A run makes the
# request's next step a multi-token slice, so that step is no longer decode-only (no decode graph, the prompt
# attention path) for every request in it: on the H200 (run 63, W6) runs made batch 1 1.25x faster than
# unconstrained decoding, but 256 constrained streams 0.47x against 0.64x without them.
JUMP_MAX_ROWS = 32


class DeviceMasks:
    """The device's bitmask rows and states, and the vocabulary's UTF-8 table, resident."""

    def __init__(self, rows: int, words: int, utf8_allowed: np.ndarray, device: torch.device) -> None:
        with torch.inference_mode(False):
            self.bits = torch.zeros((rows, words), dtype=torch.int32, device=device)
            self.states = torch.zeros(rows, dtype=torch.int64, device=device)
            self.utf8 = torch.from_numpy(np.ascontiguousarray(utf8_allowed[:, :words])).to(device)

    def upload(self, host: HostRows, n: int) -> torch.Tensor:
        """Rows [0, n) to the device, each ANDed there with its state's UTF-8 row: the step's bitmask."""
        bits, states = self.bits[:n], self.states[:n]
        bits.copy_(host.bits[:n], non_blocking=True)
        states.copy_(host.states[:n], non_blocking=True)
        if host.copied is not None:
            host.copied.record()
        bits.bitwise_and_(self.utf8.index_select(0, states))
        return bits


def by_home(entries: list[tuple[int, RequestGrammar]]) -> dict[MatcherHome, tuple[list[int], list[int]]]:
    """(rows, slots) of each home's live requests among (row, grammar) `entries`."""
    out: dict[MatcherHome, tuple[list[int], list[int]]] = {}
    for row, grammar in entries:
        if not grammar.removed:
            rows, slots = out.get(grammar.home) or out.setdefault(grammar.home, ([], []))
            rows.append(row)
            slots.append(grammar.slot)
    return out


class MarkTicket:
    """Which message of its home (`seq`) carries an awaited draw's mark: set when the mark is sent."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq: int | None = None


class FillJob:
    """One constrained step's follow-up (`GrammarTable.follow`): `accept()` waits for the step's tokens and
    hands them to its requests' homes (a token one refuses fails that request in this step's own output, when
    the home can tell at once), which fill each request's next row in `host` (row i for `grammars[i]`). The
    core's read of the step runs it (`GrammarTable.advance`), or the next fill where nobody reads the step
    (on a tensor-parallel worker).

    Jump-forward: a jumping request's matcher then also takes the tokens its constraint forces, which go
    to the core with the step's output (`ModelRunnerOutput.forced`). When the step planned after this one
    samples that request (`sampled_next`, set by its plan before this job accepts: overlapped scheduling),
    that draw is already under way: its row allows the run's first token alone, and the core counts the
    draw as that token; otherwise the row is the mask after the whole run."""

    def __init__(
        self, step: StepResult, rows: list[tuple[int, RequestGrammar]], host: HostRows, step_rows: int = 1
    ) -> None:
        self.grammars = [grammar for _, grammar in rows]
        self.index = {grammar: i for i, grammar in enumerate(self.grammars)}
        self.host = host
        self._step = step
        self._sampled = [row for row, _ in rows]  # host row i's sampled row in the step
        self._output: ModelRunnerOutput | None = None
        self.sampled_next: list[tuple[int, RequestGrammar]] = []  # the next step's constrained rows, if planned
        # Homes whose rows a queued draw waits for on the device: each sets its flag of this job's rows to the
        # mark once they are written (`GrammarTable.fill`, awaited); for the grammar process the ticket
        # learns which message carries it.
        self.marks: dict[MatcherHome, tuple[int, MarkTicket]] = {}
        # This job's step drew from rows nobody waited for on the host (awaited): the errors the fills of
        # those rows found (their replies, up to the ticket's message) fail its requests when it is read.
        self.ticket: MarkTicket | None = None
        # The job whose accept sets the marks this job's draw waits for: accepted before this job's step is
        # read, even where the core dropped it (an error mid-step), or that read would wait forever.
        self.after: FillJob | None = None
        # Runs are taken only after steps of few rows (`JUMP_MAX_ROWS`): the step's count, in either schedule.
        self._jump = step_rows <= JUMP_MAX_ROWS

    @property
    def accepted(self) -> bool:
        return self._output is not None

    def accept(self) -> ModelRunnerOutput:
        """The step's output with the refusals known at once (waits for the step); the rows are under way."""
        if self._output is not None:
            return self._output
        setter, self.after = self.after, None
        if setter is not None:
            setter.accept()  # a no-op unless its step was never read
        output = self._step.result()
        late = self._late_errors(self.ticket) if self.ticket is not None else {}
        # With marks, an upload from these rows waits on the device for them: not for it (the upload before
        # it preceded this step's draw, so it is done).
        if not self.marks:
            self.host.writable()
        homes = self._by_home(output.sampled_token_ids)
        failed: dict[int, str | AsyncLLMError] = dict(late)
        # Verified drafts: the tokens before each run's last go to the matchers first (each home's `leads`).
        leads = self._leads(homes, output.accepted) if output.accepted else {}
        # The grammar process's share first: it works while the step thread does its own.
        jumping = any(g.jumps for g in self.grammars)
        for home in sorted(homes, key=lambda h: not h.beside):
            rows, slots, tokens = homes[home]
            if not rows:
                continue
            # A row its mask left empty draws token 0, and its refusal must end the request now, before the
            # token is output: only then does this step wait for the grammar process's verdict.
            mark, ticket = self.marks.pop(home, (0, None))
            if jumping:
                jump = self._jump
                after = {g.slot: g for _, g in self.sampled_next if g.home is home and g.jumps} if jump else {}
                home.step(self.host, rows, slots, tokens, 0 in tokens, after, jump, mark, leads.get(home))
                for slot in after.keys() & home.forced().keys():
                    # That draw repeats the run's first token: its noise offset is the next real draw's, as
                    # when the run is known before the next step is planned (serial scheduling).
                    state = after[slot].state
                    assert state is not None
                    state.num_sampled -= 1
            else:
                home.step(self.host, rows, slots, tokens, verdict=0 in tokens, mark=mark, leads=leads.get(home))
            if ticket is not None and home.beside:
                ticket.seq = home.last_seq
        for home, (mark, ticket) in self.marks.items():  # homes with no row of this step's: the mark alone
            home.mark(self.host, mark)
            if home.beside:
                ticket.seq = home.last_seq
        self.marks = {}
        forced: dict[int, list[int]] = {}
        for home, (rows, slots, _) in homes.items():
            if not rows:  # no step of this job's there (its requests ended): what it holds is another job's
                continue
            refused = home.refusals()
            runs = home.forced() if jumping else None
            if refused or runs:
                row_of = {slot: self._sampled[row] for row, slot in zip(rows, slots)}
                failed.update((row_of[slot], error) for slot, error in refused.items())
                if runs:
                    forced.update((row_of[slot], run) for slot, run in runs.items())
        if failed or forced:
            output = replace(output, failed={**(output.failed or {}), **failed} or None, forced=forced or None)
        self._output = output
        return output

    def _leads(
        self, homes: dict[MatcherHome, tuple[list[int], list[int], list[int]]], accepted: dict[int, list[int]]
    ) -> dict[MatcherHome, list[list[int]]]:
        """A verifying step's accepted runs, by home: each drafted row's own token and its accepted drafts
        but the last, which its matchers take before the step's token; that token becomes the run's last (the
        target's token after them), in place. A refusal among them is reported as any step's (every token of
        an accepted run is one its verifying row's mask allowed: a refusal is a bug, ending the request)."""
        out: dict[MatcherHome, list[list[int]]] = {}
        for home, (rows, _, tokens) in homes.items():
            runs = [accepted.get(self._sampled[row], []) for row in rows]
            if any(runs):
                out[home] = [[token, *run[:-1]] if run else [] for token, run in zip(tokens, runs)]
                tokens[:] = [run[-1] if run else token for token, run in zip(tokens, runs)]
        return out

    def _late_errors(self, ticket: MarkTicket) -> dict[int, str | AsyncLLMError]:
        """The errors, by sampled row, that the fills of this step's rows reported (their replies come as
        soon as asked for: the device has read the rows), or the failure of a home that died: those requests
        end with this step (their rows allowed any token). Replies after the ticket's stay for later steps."""
        failed: dict[int, str | AsyncLLMError] = {}
        for home in {g.home for g in self.grammars if not g.removed}:
            errors = home.collect(ticket.seq)  # the step thread's: what its fills found, at once
            for i, grammar in enumerate(self.grammars):
                if grammar.home is not home or grammar.removed:
                    continue
                error = home.failure or errors.get(grammar.slot) or grammar.error
                if error is not None:
                    grammar.error = grammar.error or error
                    failed[self._sampled[i]] = grammar.error
        return failed

    def _by_home(self, sampled: list[int]) -> dict[MatcherHome, tuple[list[int], list[int], list[int]]]:
        """Each home's (host rows, slots, tokens) of the step's live requests: comprehensions in the common
        case (one home), a loop where homes mix (while the grammar process starts) or requests have ended."""
        grammars, at = self.grammars, self._sampled
        if not grammars:  # every constrained row of its step sat out (deferral.py)
            return {}
        home = grammars[0].home
        if all(g.home is home for g in grammars):
            live = [i for i, g in enumerate(grammars) if not g.removed]
            if len(live) == len(grammars):
                return {home: (live, [g.slot for g in grammars], [sampled[r] for r in at])}
            return {home: (live, [grammars[i].slot for i in live], [sampled[at[i]] for i in live])}
        homes: dict[MatcherHome, tuple[list[int], list[int], list[int]]] = {}
        for i, grammar in enumerate(grammars):
            if not grammar.removed:
                rows, slots, tokens = homes.get(grammar.home) or homes.setdefault(grammar.home, ([], [], []))
                rows.append(i)
                slots.append(grammar.slot)
                tokens.append(sampled[at[i]])
        return homes


@dataclass
class MaskPlan:
    """Where a step's constrained rows find their masks (`GrammarTable.plan`)."""

    rows: list[int]  # each sampled row's bitmask row, -1 where unconstrained: staged with the step's inputs
    source: FillJob | None  # the job whose rows [0, len(source.grammars)) the step reuses
    extras: list[tuple[int, RequestGrammar]]  # rows filled at `fill`, for requests the job did not cover
    constrained: list[tuple[int, RequestGrammar]]  # (sampled row, its grammar), in row order
    num_rows: int  # bitmask rows uploaded
    ticket: MarkTicket | None = None  # awaited (`GrammarTable.fill`): which message carries the rows' mark
    after: FillJob | None = None  # awaited: the job that sets the marks (it must be accepted first)
    follows: list[bool] = field(default_factory=list)  # per sampled row: its input is its request's last draw
    num_seqs: int = 0  # the step's sequences (sampled or not)
    deferred: list[int] = field(default_factory=list)  # sampled rows whose draw sits out (`fill`: deferral.py)
    # Verifying drafts (`draft_rows.py`): (sampled row, bitmask rows, grammar, drafts) of each constrained drafted
    # sequence; the most drafts a sampled row may accept (where its grammar forces text after one, jump-forward,
    # or its drafted rows were not filled in time, in the slow lane); the lane's rows under way, by sampled row.
    drafted: list[tuple[int, list[int], RequestGrammar, list[int]]] = field(default_factory=list)
    draft_caps: dict[int, int] = field(default_factory=dict)
    lane_drafts: dict[int, Future[DraftRows]] = field(default_factory=dict)
