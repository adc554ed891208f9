"""Speculative decoding's verify phase, the runner's side: which logit rows a step's drafts add
(`plan_verify`), and the read that turns their draws into accepted runs (`VerifiedRead`).

A sequence with k drafts gets the logits of its last 1 + k positions; each row is drawn as the request's
next draws would be without drafts (its seed, at its draw count plus the row's place), so row j holds the
token the target gives after the drafts before it. Drafts are accepted while they equal those tokens; the
token after the last accepted draft is the target's own. Greedy and seeded output are therefore exactly
what the engine gives without drafts, and unseeded output keeps the target's distribution (every output
token is a draw of the target's).

A chained sequence (`ScheduledSeq.chained`) was planned before its request's previous verifying step was read,
as if that step accepts every draft; its first input is that step's last row's token (each sequence's last row
is recorded as its request's latest token). Its request's state says whether it did (`all_accepted`, set by
the previous read): if not, the sequence is void, every draw it took is given back and nothing of it is
output (the core, which knows the same, drops it too). Knows nothing of models or the core's requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from asyncllm.sample.state import SamplingState
from asyncllm.step import ModelRunnerOutput, SchedulerOutput, StepResult


@dataclass(frozen=True)
class VerifyPlan:
    """A verifying step's logit rows: every sampled sequence's rows in order, 1 + its drafts each."""

    states: list[SamplingState]  # [R] each row's request state (a drafted request's repeated)
    ahead: list[int]  # [R] each row's draws ahead of its state's count (its place after the first)
    first: list[int]  # [S] each sampled sequence's first row
    drafts: list[list[int]]  # [S] each sampled sequence's drafts ([] for a plain row)
    before: list[list[int]]  # [R] the drafts each row's draw follows in this step (row j: the first j)
    chained: list[bool]  # [S] whether each sampled sequence was planned as if its previous step accepts all

    @property
    def last(self) -> list[int]:
        """[S] each sampled sequence's last row (its token is the request's latest if every draft is accepted)."""
        return [row + len(drafts) for row, drafts in zip(self.first, self.drafts)]

    def rows_of(self, sequences: list[int]) -> list[int]:
        """The logit rows of these sampled sequences (a draw that sits out skips every row of its sequence)."""
        return [r for i in sequences for r in range(self.first[i], self.first[i] + 1 + len(self.drafts[i]))]


def plan_verify(scheduled: SchedulerOutput, states: list[SamplingState]) -> VerifyPlan:
    """The rows of a step whose sequences carry drafts (`ScheduledSeq.num_drafts`); `states`: the sampled
    sequences' states, in order."""
    rows: list[SamplingState] = []
    ahead: list[int] = []
    first: list[int] = []
    drafts: list[list[int]] = []
    before: list[list[int]] = []
    chained: list[bool] = []
    sampled = (seq for seq in scheduled.seqs if seq.sample)
    for seq, state in zip(sampled, states, strict=True):
        k = seq.num_drafts
        first.append(len(rows))
        rows += [state] * (k + 1)
        ahead += range(k + 1)
        own = seq.input_token_ids[-k:] if k else []
        drafts.append(own)
        before += [own[:j] for j in range(k + 1)]
        chained.append(seq.chained)
    return VerifyPlan(rows, ahead, first, drafts, before, chained)


class VerifiedRead:
    """A verifying step as the core reads it: each sequence's first row's token, and after it the tokens
    its drafts earned (`ModelRunnerOutput.accepted`). The sampler advanced each drafted state's draw count
    by all its rows when it launched the draw; the read gives back the draws past the accepted run, so the
    request's next draw takes the offset it would have without drafts. The request's next step is planned
    only after this read (the scheduler holds a speculative request back while a step of it is in flight)."""

    __slots__ = ("_caps", "_output", "_plan", "_sent", "_uncount")

    def __init__(
        self,
        sent: StepResult,
        plan: VerifyPlan,
        uncount: Callable[[list[tuple[SamplingState, int]]], None],
        caps: dict[int, int] | None = None,
    ) -> None:
        self._sent = sent
        self._plan = plan
        self._uncount = uncount  # the penalty table's: tokens drawn past an accepted run were never output
        # Sampled row -> the most drafts it may accept (a grammar forces text after that one: `draft_rows.py`).
        self._caps = caps or {}
        self._output: ModelRunnerOutput | None = None

    def done(self) -> bool:
        return self._sent.done()

    def start(self) -> None:
        self._sent.start()

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._accept(self._sent.result())
        return self._output

    def _accept(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        plan, tokens = self._plan, out.sampled_token_ids
        logprobs = out.logprobs
        accepted: dict[int, list[int]] = {}
        accepted_logprobs: dict[int, list[dict[int, float] | None]] = {}
        never_output: list[tuple[SamplingState, int]] = []  # (state, token) of rows past an accepted run
        sat_out = set(out.deferred or ())  # no row of theirs counted a draw (the sampler skipped them)
        for i, (row, drafts) in enumerate(zip(plan.first, plan.drafts)):
            if not drafts or i in sat_out:
                continue
            state = plan.states[row]
            if plan.chained[i] and not state.all_accepted:  # void: the step it was chained on rejected a draft
                state.num_sampled -= len(drafts) + 1  # (no penalties: a request with them is never chained)
                continue
            n, most = 0, self._caps.get(i, len(drafts))
            while n < most and tokens[row + n] == drafts[n]:
                n += 1
            state.all_accepted = n == len(drafts)
            if n:
                accepted[i] = tokens[row + 1 : row + n + 1]
                if logprobs is not None and logprobs[row] is not None:  # the request asks for them
                    accepted_logprobs[i] = logprobs[row + 1 : row + n + 1]  # each drawn at its own row
            plan.states[row].num_sampled -= len(drafts) - n  # the draws past the accepted run never happened
            if plan.states[row].penalty_row is not None:
                never_output += [(plan.states[row], tokens[r]) for r in range(row + n + 1, row + len(drafts) + 1)]
        if never_output:
            self._uncount(never_output)
        return replace(  # the rest (failures, sat-out rows, ...) as they came, by sampled sequence
            out,
            sampled_token_ids=[tokens[r] for r in plan.first],
            logprobs=[logprobs[r] for r in plan.first] if logprobs is not None else None,
            accepted=accepted or None,
            accepted_logprobs=accepted_logprobs or None,
        )
