"""Chained verification: speculative decoding that keeps overlapped scheduling. A speculative request's next
step is planned while its step verifying drafts is still in flight, as if that step accepts every draft: its
first input is that step's last row's token (a PLACEHOLDER the runner feeds on the device, the row recorded as
the request's latest token), at the position after the drafts, then drafts proposed past it (the drafter asked
for one token more after the drafts in flight, its guess of that token dropped: `AdaptiveDrafter.propose_after`).

If the step in flight accepts every draft, the chained step is exactly the step the request would have been
planned after reading it, and the host's planning overlapped the device's work. If not, the chained step is
void: the core drops its output as it comes (`Speculation.settle` counts it, `Request.num_void`), rolls its
computed count back to the accepted drafts, and the runner gives back every draw it took (`spec_verify.py`, from
the same acceptance); its KV writes land past the accepted tokens and are rewritten by the next step.

Chained only where that undoing is exact and likely needed rarely: the `ngram` method (whose index takes only
known tokens, never the drafts in flight: `NgramDrafter.propose_ahead`; suffix decoding's automaton would index
them), a request whose draws carry nothing but their count from one to the next (`sample.features.may_chain`:
no penalties, no grammar) and that has lately had every draft accepted, one chained step at a time, never one
chained on a void one. Plain Python.
"""

from __future__ import annotations

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.spec.adaptive import AdaptiveDrafter
from asyncllm.sample.features import may_chain
from asyncllm.step import PLACEHOLDER, ScheduledSeq, SchedulerOutput


def chain_drafts(drafter: AdaptiveDrafter, request: Request, limit: int) -> list[int]:
    """The drafts (at most `limit`) of a step of `request` chained on its verifying step in flight, or [] where
    it is not to be chained."""
    if (
        limit < 1
        or request.num_verifying != 1
        or request.num_pending_tokens != 1
        or request.num_void
        or request.sits_out
        or not may_chain(request.params)
    ):
        return []
    drafts = request.drafts_in_flight
    if not drafter.expects_all(request.request_id, len(drafts)):
        return []
    return drafter.propose_after(request.request_id, request.all_token_ids, drafts, limit)


def plan_chained(
    block_manager: BlockManager, drafter: AdaptiveDrafter, request: Request, most: int, out: SchedulerOutput
) -> int:
    """Plan a step of `request` chained on its verifying step in flight into `out`, where it may be, with at most
    `most` drafts; its tokens (0: none planned)."""
    after = len(request.drafts_in_flight) + 1  # the drafts in flight and the token after them
    room = request.max_tokens - request.num_output_tokens - request.num_pending_tokens - after
    drafts = chain_drafts(drafter, request, min(most, room))
    if not drafts or not block_manager.allocate(request, after + len(drafts)):
        return 0
    out.seqs.append(chained_seq(request, drafts))
    out.num_draft_tokens += len(drafts)
    return 1 + len(drafts)


def chained_seq(request: Request, drafts: list[int]) -> ScheduledSeq:
    """The chained step's slice of `request` (its blocks allocated for it), the request's counts advanced as if
    every draft in flight is accepted."""
    assumed = len(request.drafts_in_flight)
    start = request.num_computed_tokens + assumed
    request.num_computed_tokens = start + 1
    request.chained_on = assumed
    request.num_pending_tokens += 1
    request.num_verifying += 1
    request.drafts_in_flight = drafts
    inputs = [PLACEHOLDER, *drafts]
    return ScheduledSeq(request.request_id, inputs, start, list(request.block_ids), True, len(drafts), chained=True)


def settle_chained_on(request: Request, num_accepted: int) -> None:
    """`request`'s step that its chained step in flight assumed all accepted was read, and accepted
    `num_accepted` of its drafts: with fewer, the chained step is void (its output dropped as it comes, its
    computed count rolled back to the accepted drafts); either way the chained step's count already holds them."""
    assumed, request.chained_on = request.chained_on, 0
    if num_accepted == assumed:
        return
    request.num_void += 1
    request.num_pending_tokens -= 1
    request.num_drawn_ahead += 1  # its token, when it comes, is dropped as a forced run's drawn-ahead one is
    if request.status is RequestStatus.RUNNING:  # (a preempted one recomputes everything anyway)
        request.num_computed_tokens -= assumed + 1 - num_accepted
