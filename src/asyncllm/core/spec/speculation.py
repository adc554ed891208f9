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

from asyncllm.config_speculative import SpeculativeConfig
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.spec.adaptive import AdaptiveDrafter
from asyncllm.core.spec.drafter import Drafter
from asyncllm.core.spec.ngram import NgramDrafter
from asyncllm.core.spec.suffix import SuffixDrafter
from asyncllm.sample.features import may_verify
from asyncllm.step import SchedulerOutput


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.drafter = AdaptiveDrafter(make_drafter(config), config.num_speculative_tokens)
        self.num_draft_tokens = 0  # drafts verified so far
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_drafts = 0  # proposals verified (a request's drafts in one step)
        self.accepted_per_position = [0] * config.num_speculative_tokens  # accepted drafts by their position

    @staticmethod
    def eligible(request: Request) -> bool:
        """Whether `request`'s decodes (each of its samples', with n > 1) may carry drafts: every sampling feature
        it asks for is one verification keeps exact (`sample.features.may_verify`). A LoRA request's drafts run
        through its adapter as its other inputs do: the runner maps each sequence's query rows, drafts included,
        to its adapter's slot. A sample's drafts write KV only past its prompt, into blocks it owns alone: its
        group shares the prompt's full blocks but the one holding its last token (`sample_group.py`)."""
        return may_verify(request.params)

    def settle(
        self,
        scheduled: SchedulerOutput,
        accepted: dict[int, list[int]] | None,
        requests: dict[str, Request],
    ) -> None:
        """After a verifying step's tokens were appended: each live drafted request's accepted drafts hold
        computed KV (unless it was preempted meanwhile: it recomputes everything); the counters."""
        index = -1
        for seq in scheduled.seqs:
            if not seq.sample:
                continue
            index += 1
            if not seq.num_drafts:
                continue
            num_accepted = len(accepted.get(index, ())) if accepted is not None else 0
            self.num_draft_tokens += seq.num_drafts
            self.num_accepted_tokens += num_accepted
            self.num_drafts += 1
            for position in range(num_accepted):
                self.accepted_per_position[position] += 1
            self.drafter.observe(seq.request_id, seq.num_drafts, num_accepted)
            request = requests.get(seq.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished (its blocks are free) or preempted (its KV dropped)
            request.num_computed_tokens += num_accepted


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The host-side drafter of `config.method`."""
    if config.method == "suffix":
        return SuffixDrafter(
            config.num_speculative_tokens,
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
    return NgramDrafter(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
