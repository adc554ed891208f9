"""Per-request sampling state the model runner keeps across steps.

Owns what a request's draws depend on: its seed, how many tokens it has drawn (the offset into its noise
stream, advanced when a draw is launched, so nothing waits for the device), the ids masked until
`min_tokens`, its row in the sampler's penalty table and whether its draws are constrained (the grammar
itself is `structured_output/`'s, which hands the sampler only a bitmask). Knows nothing of scheduling, the
model, or how logits become tokens (`sampler.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from asyncllm.sampling_params import SamplingParams


def fold_seed(seed: int) -> int:
    """Any Python int as a signed 64-bit value (the kernels' seed type): every seed maps to one stream."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass
class SamplingState:
    params: SamplingParams
    seed: int  # signed 64-bit
    prompt_token_ids: tuple[int, ...]
    # EOS (unless ignore_eos) and stop_token_ids: masked while fewer than params.min_tokens were drawn.
    min_tokens_stop_ids: tuple[int, ...] = ()
    num_sampled: int = 0  # draws so far: the noise offset of the next one
    penalty_row: int | None = None  # set by the sampler's PenaltyTable for requests with penalties
    # Speculative decoding: its last verified step accepted every draft, so a step chained on it stands
    # (worker/spec_verify.py).
    all_accepted: bool = False
    # Its draws apply a grammar's bitmask row (`params.structured` is set): a fact of the request, so the
    # sampler asks this, never the grammar's handle (structured_output/ imports sample/, not the reverse).
    constrained: bool = False
    # features.py's memo: the checks that may keep this request's rows off the plain draw, worked out from
    # its parameters on the first step that asks (`takes_plain_draw`).
    plain_draw_gates: tuple[Callable[[SamplingState], bool], ...] | None = field(
        default=None, repr=False, compare=False
    )
    # `params.greedy` (the one definition of greedy), kept as a field: read for every row of every step.
    greedy: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.greedy = self.params.greedy

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        seed: int,
        prompt_token_ids: Sequence[int],
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SamplingState:
        stops: tuple[int, ...] = ()
        if params.min_tokens > 0:
            stops = tuple(sorted(params.stop_token_set | (frozenset() if params.ignore_eos else eos_token_ids)))
        constrained = params.structured is not None
        return cls(params, fold_seed(seed), tuple(prompt_token_ids), stops, constrained=constrained)

    @property
    def masks_stops(self) -> bool:
        """EOS and stop ids are still forbidden (fewer than min_tokens drawn)."""
        return self.masks_stops_after(0)

    def masks_stops_after(self, ahead: int) -> bool:
        """EOS and stop ids are forbidden for the draw `ahead` draws after the next one (verifying drafts)."""
        return self.num_sampled + ahead < self.params.min_tokens and bool(self.min_tokens_stop_ids)

    @property
    def filters(self) -> bool:
        """top-k, top-p or min-p is asked (0 < top_k: a k that exceeds the vocabulary is handled later)."""
        p = self.params
        return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
