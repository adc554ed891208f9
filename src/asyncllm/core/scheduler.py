"""Continuous batching with no prefill/decode modes.

One rule: every running request's computed tokens catch up with its planned tokens (known, plus one
sampled by a step still in flight), within a per-step token budget and a cap on sequences. Prefill chunks,
prefix-cache hits, decodes and resumed preemptions all fall out of it; so does overlapped scheduling: a
step planned while the previous one runs feeds the in-flight token as a PLACEHOLDER.

Requests rank by priority (lower first), then arrival: the waiting queue admits in rank order
(`waiting_queue.py`) and the running list is kept in it. When blocks run out, the lowest-ranked running
request is preempted (its KV is dropped and recomputed later; with one priority, the most recently
admitted); a waiting request that outranks running ones and finds no seat or memory preempts the
lowest-ranked of them before the step is planned (vLLM's priority policy). So no request is passed by a
worse-ranked one or preempted for one: it waits only for those ranked before it (and for the step's token
budget, which running requests use first, as they always did). Plain Python, deterministic: the same
calls give the same schedule.

The samples of a request with n > 1 are requests of their own that share the prompt's blocks
(`sample_group.py`): admitting one takes them from a sibling, or waits while a sibling computes them.

With LoRA adapters, running requests use at most `max_loras` distinct ones (the device's slots,
`lora.AdapterBudget`): a waiting request whose adapter does not fit waits like one short of memory, and one
that outranks running requests preempts them until it fits.

With speculative decoding, a speculative request's decode carries drafts after its last token, their blocks
allocated with it; the step verifies them. While the engine speculates, such a request is planned while a step
of it is in flight only chained on it (spec/chain.py), and a step's drafts never take its logit rows past
`max_num_seqs`, counting a row for every request that could sample. Past `Speculation.max_seqs` running
requests no request drafts (`SchedulerOutput.propose_drafts`) and each is planned as without speculation.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.lora import AdapterBudget
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.sample_group import SampleGroup, SampleGroups
from asyncllm.core.sampled_tokens import SampledTokens
from asyncllm.core.spec.chain import plan_chained
from asyncllm.core.spec.draft_proposals import reserve_lookahead
from asyncllm.core.spec.speculation import Speculation
from asyncllm.core.waiting_queue import WaitingQueue
from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import FinishReason
from asyncllm.step import PLACEHOLDER, NewRequestData, ScheduledSeq, SchedulerOutput


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    # Prompt tokens (chunks, admissions, recomputed preemptions) a step may carry while it also decodes:
    # a long step delays every decoding request's next token (the gap between two tokens). None: no cap.
    max_prefill_tokens_while_decoding: int | None = None


class Scheduler(SampledTokens):
    def __init__(
        self,
        limits: SchedulerLimits,
        block_manager: BlockManager,
        adapters: AdapterBudget | None = None,
        groups: SampleGroups | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        self.limits = limits
        self.block_manager = block_manager
        self.adapters = adapters  # None: no LoRA (no check anywhere)
        self.groups = SampleGroups() if groups is None else groups  # the engine core's live sample groups
        self.drafter = speculation.drafter if speculation is not None else None  # None: no speculative decoding
        # Positions a draft model writes past a sampling step (spec/draft_proposals.py).
        self.lookahead = speculation.lookahead if speculation is not None else 0
        self.max_speculating = speculation.max_seqs if speculation is not None else 0
        self.chain_drafter = speculation.drafter if speculation is not None and speculation.chains else None
        self.speculating = False  # whether the step last planned drafts (for its speculative requests)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seeds: dict[str, int] = {}
        self._sent_to_runner: set[str] = set()
        self._unsent = SchedulerOutput()  # finished and preempted ids for the next step that runs the model
        self.num_preemptions = 0
        self.num_decodes_planned = 0  # sequences of the step last planned that decode (for the step's counts)
        self._num_added = 0
        self._holds: list[SampleGroup] = []  # sample groups that may hold prompt blocks (sample_group.py)

    # ------------------------------------------------------------------ membership
    def add_request(self, request: Request, seed: int) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id={request.request_id!r} is already live: give another id")
        self.requests[request.request_id] = request
        self._seeds[request.request_id] = seed
        request.arrival_index = self._num_added
        self._num_added += 1
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a live request and free its blocks exactly once. Unknown or finished ids are a no-op."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            if request.lora_id:
                self._release_adapter(request)
        else:
            self.waiting.remove(request)
        if request.group_id is not None:
            self._sample_finishing(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._seeds.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(request_id, request.output_token_ids)
        if request_id in self._sent_to_runner:
            self._sent_to_runner.discard(request_id)
            self._unsent.finished_request_ids.append(request_id)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def held_block_ids(self) -> list[int]:
        """Blocks that sample groups reference besides their samples (one entry per reference)."""
        return [b for group in self._holds for b in group.held]

    @property
    def pending_finished_ids(self) -> list[str]:
        """Finished requests the runner still holds state for: it hears of them with the next executed step."""
        return list(self._unsent.finished_request_ids)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        self.num_decodes_planned = 0
        out, self._unsent = self._unsent, SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        prefill_budget = self._prefill_budget(budget)
        capped = prefill_budget < budget  # else no check per sequence: the common case costs nothing
        preempted = False
        if self.waiting and self.running and self.waiting.peek().priority < self.running[-1].priority:
            self._make_room_for(self.waiting.peek(), min(budget, prefill_budget), out)

        running, allocate, schedule_seq = self.running, self.block_manager.allocate, self._schedule  # hot loop
        draft_rows = self._draft_rows()
        speculating = self.speculating = draft_rows > 0 and len(running) <= self.max_speculating
        out.propose_drafts = speculating
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if (
                request.has_enough_tokens
                or request.num_verifying
                or (request.num_pending_tokens and (request.sits_out or (speculating and request.speculative)))
            ):
                # Its last token is in flight: it finishes when that step's output is processed. Or a step of it
                # is whose tokens its next one starts after: drafts it verifies (a void one too: its draws are
                # given back when it is read), a draw that may sit out, or (speculating) the one drafts follow.
                if speculating and request.num_verifying and self.chain_drafter is not None:  # spec/chain.py
                    n = plan_chained(self.block_manager, self.chain_drafter, request, min(budget - 1, draft_rows), out)
                    budget, draft_rows = budget - n, draft_rows - max(n - 1, 0)
                    self.num_decodes_planned += n
                i += 1
                continue
            num_new = min(request.num_planned_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, "a running request always has a token to compute"
            if capped and not _is_decode(request, num_new):  # a prompt chunk (or a resumed one's recompute)
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    i += 1
                    continue
                prefill_budget -= num_new
            drafts: list[int] = []
            if speculating and request.speculative and draft_rows > 0 and _is_decode(request, num_new):
                assert self.drafter is not None  # room for the target's own token within budget and max_tokens
                limit = min(budget - 1, draft_rows, request.max_tokens - request.num_output_tokens - 1)
                drafts = self.drafter.propose(request.request_id, request.all_token_ids, limit)
                if drafts and not allocate(request, 1 + len(drafts)):
                    drafts = []  # short of memory: the decode goes on without them
                draft_rows -= len(drafts)
            while not allocate(request, num_new):
                if self._holds and self._release_idle_holds():
                    continue
                victim = running.pop()  # the lowest-ranked (the list is in rank order)
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            else:
                schedule_seq(request, num_new, out, drafts)
                budget -= num_new + len(drafts)
                i += 1
                continue
            break  # the request itself was preempted: everyone after it is gone too

        # Admit waiting requests in rank order, unless memory was just too short for the running ones. One whose
        # prefix comes back from a tier below the device computes from the next step, within that step's budget.
        staging = self.block_manager.tiers is not None
        stage_budget, parked = self._prefill_budget(self.limits.max_num_batched_tokens) if staging else 0, []
        while (
            self.waiting
            and not preempted
            and max(min(budget, prefill_budget), stage_budget) > 0
            and len(self.running) < self.limits.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.num_pending_tokens or request.num_verifying:
                break  # preempted with a step in flight: it resumes once that step is read (in order)
            cached = []
            group = None if request.group_id is None else self.groups.get(request.group_id)
            # One that scores its prompt (prompt logprobs) computes every position: no prefix of any kind.
            scores = request.scores_prompt
            if group is not None and not scores:
                found = group.shared_prefix(request, self.block_manager)
                if found is None:
                    break  # a sibling is computing the prompt's blocks: share them once planned
                cached = found
            if request.lora_id and not self._adapter_fits(request):
                break  # its adapter waits for a slot, as the head waits for memory
            shared = bool(cached)
            if request.num_computed_tokens == 0 and not shared and not scores:
                cached = self.block_manager.find_cached_prefix(request)
                if self.block_manager.awaits_load(request, len(cached)):
                    parked.append(self.waiting.popleft())  # its prefix is being read from disk: others go first
                    continue
            restores = self.block_manager.restores(cached)
            room = stage_budget if restores else min(budget, prefill_budget)
            num_cached_tokens = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached_tokens, room)
            if num_new <= 0 or (restores and not self.block_manager.may_restore(cached)):
                break  # no room, or the step restores all it may (ASYNCLLM_KV_RESTORE_MIB_PER_STEP)
            if request.pooling is not None and num_new < request.num_tokens:
                break  # a pooling input runs whole, in one step (core/pooling.py): it waits for a step with room
            take = self.block_manager.stage if restores else self.block_manager.allocate
            if not take(request, num_new, cached) and not (
                self._holds and self._release_idle_holds() and take(request, num_new, cached)
            ):
                break  # first come, first served: the head waits for memory
            if group is not None:
                group.admitted(request, self.block_manager)
            stage_budget -= num_new if restores else 0
            prefill_budget -= 0 if restores else num_new
            self.waiting.popleft()
            if self.block_manager.enable_prefix_caching and request.num_preemptions == 0 and not (shared or scores):
                # First admissions only: a resumed request re-finding its own blocks is not a prefix hit.
                self.block_manager.record_prefix_query(request.num_tokens, num_cached_tokens)
            request.num_computed_tokens = num_cached_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            if request.lora_id:
                assert self.adapters is not None
                self.adapters.acquire(request.lora_id)
            self._add_running(request)
            if not restores:  # else its first step is the next, after the copies (`KVTiers.restore`)
                self._schedule(request, num_new, out)
                budget -= num_new
        for request in reversed(parked):
            self.waiting.appendleft(request)
        out.kv = self.block_manager.take_transfers()
        if not out.seqs:
            # No model runs (empty, or copies alone): the next real step carries its ids (a finished request's
            # state would stay in the runner forever, a resumed one's block-table row keep its old blocks).
            self._unsent.finished_request_ids[:0] = out.finished_request_ids
            self._unsent.preempted_request_ids[:0] = out.preempted_request_ids
            out.finished_request_ids, out.preempted_request_ids = [], []
        return out

    def _add_running(self, request: Request) -> None:
        """Into the running list at its rank: with one priority, its end (requests start in arrival order)."""
        running = self.running
        if not running or _rank(running[-1]) <= _rank(request):
            running.append(request)
        else:
            running.insert(bisect.bisect_right(running, _rank(request), key=_rank), request)

    def _make_room_for(self, head: Request, max_chunk: int, out: SchedulerOutput) -> None:
        """`head`, the first waiting request, outranks the last running one: while it finds no seat, or too
        few free blocks for its first chunk (prefix hits not counted), preempt the lowest-ranked running
        request below it. Before anything is planned, so no victim has work in this step. Running requests
        may still take the freed blocks this step; each step that happens preempts at least one more below
        `head`, so it starts within as many steps as there are running requests ranked below it."""
        if head.num_pending_tokens:
            return  # preempted with a token in flight: it cannot start before that token is known
        running, bm, limits = self.running, self.block_manager, self.limits
        needed = bm.blocks_needed(min(head.num_tokens, max_chunk))
        while (
            running
            and head.priority < running[-1].priority
            and (
                len(running) >= limits.max_num_seqs
                or bm.num_free_blocks < needed
                or (head.lora_id and not self._adapter_fits(head))
            )
        ):
            self._preempt(running.pop(), out)

    def _prefill_budget(self, budget: int) -> int:
        """The step's budget for prompt tokens: capped while any running request decodes this step."""
        cap = self.limits.max_prefill_tokens_while_decoding
        if cap is None or cap >= budget:
            return budget
        # Usually settled by the first running request (in steady state everyone decodes).
        decoding = any(
            _is_decode(r, r.num_planned_tokens - r.num_computed_tokens) and not r.has_enough_tokens
            for r in self.running
        )
        return cap if decoding else budget

    def _draft_rows(self) -> int:
        """Drafts this step may carry: each is a logit row, and the step's rows stay within `max_num_seqs` (the
        runner's per-row buffers and LM head buckets) even if every running and waiting request samples in it."""
        if self.drafter is None:
            return 0
        seats = self.limits.max_num_seqs
        return seats - min(seats, len(self.running) + len(self.waiting))

    def _schedule(self, request: Request, num_new: int, out: SchedulerOutput, drafts: list[int] | None = None) -> None:
        start = request.num_computed_tokens
        if request.request_id not in self._sent_to_runner:
            self._sent_to_runner.add(request.request_id)
            out.new_requests.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    request.params,
                    self._seeds[request.request_id],
                    request.lora_id,
                    request.pooling,
                    request.speculative,
                )
            )
        end = start + num_new
        if _is_decode(request, num_new):
            self.num_decodes_planned += 1
        known = request.all_token_ids
        inputs = known[start:end]
        if end > len(known):  # the last input is the token the in-flight step samples
            assert end == len(known) + 1 == request.num_planned_tokens, "one token in flight at most"
            inputs.append(PLACEHOLDER)
        sample = end == request.num_planned_tokens
        num_drafts = 0
        if drafts:  # after its last token, whose logits verify the first draft
            inputs += drafts
            num_drafts = len(drafts)
            out.num_draft_tokens += num_drafts
            self.num_decodes_planned += num_drafts
            request.num_verifying += 1
            request.drafts_in_flight = drafts
        if sample and self.lookahead and request.speculative and self.speculating:
            reserve_lookahead(self.block_manager, request, end + num_drafts, self.lookahead, len(self.running))
        out.seqs.append(ScheduledSeq(request.request_id, inputs, start, list(request.block_ids), sample, num_drafts))
        # Advanced now, not when outputs return, so a later step can be planned before this one finishes.
        request.num_computed_tokens = end
        if sample:
            request.num_pending_tokens += 1

    def _sample_finishing(self, request: Request) -> None:
        group = self.groups.get(request.group_id) if request.group_id is not None else None
        assert group is not None
        if group.finishing(request, self.block_manager):
            self._holds.append(group)
        elif self._holds:
            self._holds = [g for g in self._holds if g.held]

    def _release_idle_holds(self) -> bool:
        """Memory is short: sample groups none of whose samples run let go of their prompt blocks."""
        released = [g for g in self._holds if g.release_if_idle(self.block_manager)]
        self._holds = [g for g in self._holds if g.held]
        return bool(released)

    def _adapter_fits(self, request: Request) -> bool:
        return self.adapters is None or self.adapters.fits(request.lora_id)

    def _release_adapter(self, request: Request) -> None:
        assert self.adapters is not None
        self.adapters.release(request.lora_id)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if request.lora_id:
            self._release_adapter(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        out.preempted_request_ids.append(request.request_id)


def _rank(request: Request) -> tuple[int, int]:
    """Lower runs first: priority, then arrival."""
    return request.priority, request.arrival_index


def _is_decode(request: Request, num_new: int) -> bool:
    """One new token past the prompt: the request's next token (a prompt's last token is prompt work)."""
    return num_new == 1 and request.num_computed_tokens >= request.num_prompt_tokens
