"""`Speculation`: the engine core's side of speculative decoding. Decides which requests get drafts, owns the
drafter the scheduler asks, and settles each verified step: the accepted drafts' KV counted as computed,
and the running totals `stats()` reports.

Rejected drafts' KV is rolled back by position: the request's computed count stops after its accepted
drafts, so its next step writes those positions again. The blocks allocated past its tokens stay with it
(room for its next drafts, freed with the request): a block table only grows while its request runs (the
runner rewrites a row's new entries alone). None of them is registered in the prefix cache with a rejected
draft's KV: a block is registered only once every position in it holds a known token whose KV is computed
by the end of that step (`BlockManager._register_full_blocks`).

Verification itself is the runner's (the sample phase draws the target's token at every drafted position
with the noise it would use without drafts); the accepted tokens come back in `ModelRunnerOutput.accepted`
and the core appends them as it appends a forced run. Plain Python.
"""

from __future__ import annotations

from typing import Any

from asyncllm.config_speculative import SpeculativeConfig
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.spec.adaptive import AdaptiveDrafter
from asyncllm.core.spec.chain import settle_chained_on
from asyncllm.core.spec.draft_proposals import DraftProposals
from asyncllm.core.spec.drafter import Drafter
from asyncllm.core.spec.ngram import NgramDrafter
from asyncllm.core.spec.suffix import SuffixDrafter
from asyncllm.sample.features import may_verify
from asyncllm.step import ModelRunnerOutput, SchedulerOutput


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        inner = make_drafter(config)
        self.drafter = AdaptiveDrafter(inner, config.num_speculative_tokens)
        # "draft_model", "eagle3": the runner's proposals, kept until the scheduler asks (draft_proposals.py), and
        # the positions past a sampling step's tokens the draft writes while it drafts.
        self.proposals = inner if isinstance(inner, DraftProposals) else None
        self.lookahead = config.num_speculative_tokens if self.proposals is not None else 0
        self.max_seqs = config.max_speculating_seqs  # past this many running requests, a step drafts for none
        self.chains = config.method == "ngram"  # steps may be chained on verifying ones (chain.py)
        self.num_draft_tokens = 0  # drafts verified so far
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_drafts = 0  # proposals verified (a request's drafts in one step)
        self.accepted_per_position = [0] * config.num_speculative_tokens  # accepted drafts by their position
        self.num_chained_drafts = 0  # of the drafts verified, those of steps chained on one in flight (chain.py)
        self.num_void_drafts = 0  # drafts of chained steps found void (never verified, not counted above)

    def stats(self) -> dict[str, Any]:
        """The running totals, as `EngineStats` names them."""
        return {
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_num_drafts": self.num_drafts,
            "spec_accepted_per_position": tuple(self.accepted_per_position),
            "spec_chained_drafts": self.num_chained_drafts,
            "spec_void_drafts": self.num_void_drafts,
        }

    @staticmethod
    def eligible(request: Request) -> bool:
        """Whether `request`'s decodes (each of its samples', with n > 1) may carry drafts: every sampling feature
        it asks for is one verification keeps exact (`sample.features.may_verify`). A LoRA request's drafts run
        through its adapter as its other inputs do: the runner maps each sequence's query rows, drafts included,
        to its adapter's slot. A sample's drafts write KV only past its prompt, into blocks it owns alone: its
        group shares the prompt's full blocks but the one holding its last token (`sample_group.py`). A
        constrained request's drafted rows are masked by its grammar after the drafts before each
        (`structured_output/draft_rows.py`): a draft the grammar refuses is never accepted."""
        return may_verify(request.params)

    def settle(self, scheduled: SchedulerOutput, output: ModelRunnerOutput, requests: dict[str, Request]) -> None:
        """After a step's tokens were appended: each live drafted request's accepted drafts hold computed KV
        (unless it was preempted meanwhile: it recomputes everything); the counters; the draft model's
        proposals for the next steps (`ModelRunnerOutput.drafts`), kept for the requests still running."""
        accepted, offered = output.accepted, output.drafts
        if not scheduled.num_draft_tokens and not offered:
            return
        sat_out = set(output.deferred or ())  # its constraint's mask was not ready: its drafts were not verified
        index = -1
        for seq in scheduled.seqs:
            if not seq.sample:
                continue
            index += 1
            if offered is not None and index in offered and self.proposals is not None:
                live = requests.get(seq.request_id)
                if live is not None and live.status is RequestStatus.RUNNING:
                    self.proposals.offer(seq.request_id, live.all_token_ids, offered[index])
            if not seq.num_drafts or index in sat_out:
                continue
            request = requests.get(seq.request_id)
            if request is not None and seq.chained and request.num_void:  # void (chain.py): never verified
                request.num_void -= 1
                self.num_void_drafts += seq.num_drafts
                continue
            self.num_chained_drafts += seq.num_drafts if seq.chained else 0
            num_accepted = len(accepted.get(index, ())) if accepted is not None else 0
            self.num_draft_tokens += seq.num_drafts
            self.num_accepted_tokens += num_accepted
            self.num_drafts += 1
            for position in range(num_accepted):
                self.accepted_per_position[position] += 1
            self.drafter.observe(seq.request_id, seq.num_drafts, num_accepted)
            if request is None or request.status is RequestStatus.FINISHED:
                continue  # its blocks are free
            if request.chained_on:  # a step chained on this one is in flight: it counted the drafts already
                settle_chained_on(request, num_accepted)
            elif request.status is RequestStatus.RUNNING:  # (a preempted one's KV was dropped)
                request.num_computed_tokens += num_accepted


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The drafter of `config.method` (a draft model's: the proposals the runner hands up)."""
    if config.runs_model:  # "draft_model", "eagle3"
        return DraftProposals()
    if config.method == "suffix":
        return SuffixDrafter(
            config.num_speculative_tokens,
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
    # One token more than the method's k: a chained step's proposal starts with a guess of the token before its
    # drafts (chain.py); the adaptive cap keeps every other proposal within k.
    return NgramDrafter(config.num_speculative_tokens + 1, config.prompt_lookup_min, config.prompt_lookup_max)
