"""Every sampling feature, declared once: the `SamplingParams` fields that ask for it, what it needs besides the
logits, and how each fast path treats it (vLLM v1's `LogitsProcessor.is_argmax_invariant` is the model).

The fast paths' eligibility is derived from these declarations, never listed by hand: `takes_plain_draw` (a
decode step's draw inside a CUDA graph), `may_jump` (jump-forward) and `may_verify` (speculative decoding).
A new logit-shaping parameter is one more `Feature` in `FEATURES`; tests/sample/test_features.py runs every
feature through every path. How a feature is applied lives in its own module (filters.py, penalties.py,
logprobs.py, structured_output/...); this one knows only what each feature asks of a path.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

__all__ = ["FEATURES", "Feature", "Handling", "Need", "Path", "may_jump", "may_verify", "takes_plain_draw"]


class Path(enum.Enum):
    """A way to a row's next token other than the eager sampler (`Sampler.__call__`, which applies every
    feature): each may leave a feature out only where that feature says so."""

    PLAIN_DRAW = "plain draw"  # the draw alone over the raw logits at a temperature (worker/graph_draw.py)
    JUMP_FORWARD = "jump forward"  # a token the grammar forces, output with no draw (structured_output/)
    # Drafts accepted where they equal the target's draws, every position of a step drawn as it would be
    # without them (the row's seed at its draw count plus the position): a request gets drafts only where
    # every feature it asks for is one this path applies or skips.
    VERIFY = "speculative verification"


class Handling(enum.Enum):
    """What a path does with a feature a row asks for."""

    APPLIES = "applies"  # the path does it itself (the plain draw's temperature and seed)
    SKIPS = "skips"  # the path leaves it out and still gives the eager sampler's tokens and outputs
    # Argmax invariant: it never moves a row's largest logit, so a greedy row may leave it out; others may not.
    SKIPS_IF_GREEDY = "skips if greedy"
    NEEDS_EAGER = "needs eager"  # a row that asks for it takes the eager sampler (VERIFY: gets no drafts)

    def allows(self, greedy: bool) -> bool:
        """Whether a row asking for the feature may take the path."""
        return self is Handling.APPLIES or self is Handling.SKIPS or (self is Handling.SKIPS_IF_GREEDY and greedy)


class Need(enum.Enum):
    """What a feature reads besides the step's logits."""

    ROW_PARAMS = "per-row numbers, uploaded with the step"
    DRAW_COUNT = "the request's draws so far (SamplingState.num_sampled)"
    TOKEN_HISTORY = "the request's prompt and drawn tokens, counted on the device (PenaltyTable)"
    STOP_IDS = "the request's EOS and stop token ids"
    TOKEN_MASK = "a grammar's bitmask row, filled by structured_output/ (TokenMask)"
    RAW_LOGITS = "the logits before any feature shaped them"
    PROMPT_HIDDEN = "the hidden states of the prompt's positions"


@dataclass(frozen=True)
class Feature:
    """One sampling feature. `asked` tells from a request's parameters whether it uses the feature; `acts`
    whether the feature acts on a row this step (where that is more than `asked`: min_tokens' stop mask
    lasts until the request has drawn enough, penalties act once the sampler gave the row its table row).
    For a state fresh from `SamplingState.create` (and `Sampler.add`) the two agree: the test holds them to it.
    The paths ask `acts` (the plain draw, per step) or `asked` (jump-forward, once per request)."""

    name: str
    fields: tuple[str, ...]  # the SamplingParams fields it reads
    needs: frozenset[Need]
    plain_draw: Handling
    jump_forward: Handling
    verify: Handling
    asked: Callable[[SamplingParams], bool]
    acts: Callable[[SamplingState], bool]

    def handling(self, path: Path) -> Handling:
        if path is Path.VERIFY:
            return self.verify
        return self.plain_draw if path is Path.PLAIN_DRAW else self.jump_forward


_ALWAYS = frozenset({Need.ROW_PARAMS})

# Why each path may skip a feature: the plain draw is `gumbel_argmax` over the raw logits at the row's
# temperature (0: greedy) with its seed and draw count, nothing else; a forced token is the one token the
# grammar allows, so it is the eager draw's token under any feature that keeps the largest allowed logit.
FEATURES: tuple[Feature, ...] = (
    # Greedy or a temperature, every row (SamplingParams.greedy is the one definition of greedy).
    Feature(
        "temperature",
        ("temperature",),
        _ALWAYS,
        plain_draw=Handling.APPLIES,
        jump_forward=Handling.SKIPS,  # any temperature draws the only allowed token
        verify=Handling.APPLIES,
        asked=lambda p: True,
        acts=lambda s: True,
    ),
    # Every row draws from its seed's noise stream (its own seed, or one the engine drew for it) at its draw
    # count; a forced token takes no noise and no offset (FillJob gives back a draw that repeats one).
    Feature(
        "seed",
        ("seed",),
        frozenset({Need.ROW_PARAMS, Need.DRAW_COUNT}),
        plain_draw=Handling.APPLIES,
        jump_forward=Handling.SKIPS,
        verify=Handling.APPLIES,
        asked=lambda p: True,
        acts=lambda s: True,
    ),
    # top-k, top-p and min-p keep each row's largest logit (filters.py): argmax invariant, so greedy rows
    # ignore them in the eager sampler too; the grammar's mask comes first, so a forced token survives them.
    Feature(
        "top_k",
        ("top_k",),
        _ALWAYS,
        plain_draw=Handling.SKIPS_IF_GREEDY,
        jump_forward=Handling.SKIPS,
        verify=Handling.APPLIES,
        asked=lambda p: p.top_k > 0,
        acts=lambda s: s.params.top_k > 0,
    ),
    Feature(
        "top_p",
        ("top_p",),
        _ALWAYS,
        plain_draw=Handling.SKIPS_IF_GREEDY,
        jump_forward=Handling.SKIPS,
        verify=Handling.APPLIES,
        asked=lambda p: p.top_p < 1.0,
        acts=lambda s: s.params.top_p < 1.0,
    ),
    Feature(
        "min_p",
        ("min_p",),
        _ALWAYS,
        plain_draw=Handling.SKIPS_IF_GREEDY,
        jump_forward=Handling.SKIPS,
        verify=Handling.APPLIES,
        asked=lambda p: p.min_p > 0.0,
        acts=lambda s: s.params.min_p > 0.0,
    ),
    # Repetition, presence and frequency penalties move the argmax, and their counts grow from every drawn
    # token on the device (penalties.py): a forced token, never drawn, would go uncounted. A verifying row
    # counts the drafts before it as output, and the draws past an accepted run are uncounted at the read.
    Feature(
        "penalties",
        ("repetition_penalty", "presence_penalty", "frequency_penalty"),
        frozenset({Need.ROW_PARAMS, Need.TOKEN_HISTORY}),
        plain_draw=Handling.NEEDS_EAGER,
        jump_forward=Handling.NEEDS_EAGER,
        verify=Handling.APPLIES,
        asked=lambda p: p.has_penalties,
        acts=lambda s: s.penalty_row is not None,
    ),
    # OpenAI's logit_bias is added to the logits (sampler.py): it moves the argmax, so no path may leave it out
    # but jump-forward, whose forced token is the one the grammar allows whatever a finite bias does.
    Feature(
        "logit_bias",
        ("logit_bias",),
        _ALWAYS,
        plain_draw=Handling.NEEDS_EAGER,
        jump_forward=Handling.SKIPS,
        verify=Handling.APPLIES,
        asked=lambda p: bool(p.bias_items),
        acts=lambda s: bool(s.params.bias_items),
    ),
    # EOS and stop ids are masked until min_tokens are drawn (sampler.py); forced tokens are never stop ids
    # (jump_forward.py keeps them out), so the mask cannot change one. A verifying row counts the draws before
    # it in the step (`ahead`), so each position masks exactly as it would without drafts.
    Feature(
        "min_tokens",
        ("min_tokens", "stop_token_ids", "ignore_eos"),
        frozenset({Need.DRAW_COUNT, Need.STOP_IDS}),
        plain_draw=Handling.NEEDS_EAGER,
        jump_forward=Handling.SKIPS,
        verify=Handling.APPLIES,
        asked=lambda p: p.min_tokens > 0,
        acts=lambda s: s.masks_stops,
    ),
    # Logprobs of the raw logits (logprobs.py): an output the plain draw does not make, and a forced token
    # has no drawn distribution to report. Verifying, every row reports its own: an accepted draft's entry is
    # its row's (`ModelRunnerOutput.accepted_logprobs`), one entry per output token.
    Feature(
        "logprobs",
        ("logprobs",),
        frozenset({Need.RAW_LOGITS}),
        plain_draw=Handling.NEEDS_EAGER,
        jump_forward=Handling.NEEDS_EAGER,
        verify=Handling.APPLIES,
        asked=lambda p: p.logprobs is not None,
        acts=lambda s: s.params.logprobs is not None,
    ),
    # The prompt's logprobs are scored with the prompt's forward pass (prompt_logprobs.py), never in a decode
    # draw; a request that asks for scores draws every token, so no forced run is output unscored.
    Feature(
        "prompt_logprobs",
        ("prompt_logprobs",),
        frozenset({Need.PROMPT_HIDDEN}),
        plain_draw=Handling.SKIPS,
        jump_forward=Handling.NEEDS_EAGER,
        verify=Handling.APPLIES,
        asked=lambda p: p.prompt_logprobs is not None,
        acts=lambda s: s.params.prompt_logprobs is not None,
    ),
    # Structured output: the draw applies the grammar's bitmask row (the graphed draw has none); jump-forward
    # is the grammar's own path. A verifying row's mask is the grammar's after the drafts before it (the
    # matcher accepts them, then rolls back: structured_output/draft_rows.py).
    Feature(
        "structured_output",
        ("json_schema", "regex", "choice", "grammar", "json_object"),
        frozenset({Need.TOKEN_MASK}),
        plain_draw=Handling.NEEDS_EAGER,
        jump_forward=Handling.APPLIES,
        verify=Handling.APPLIES,
        asked=lambda p: p.structured is not None,
        acts=lambda s: s.constrained,
    ),
)

# Why verification may apply a feature: each position's logits are shaped by the row's own parameters alone
# (temperature, filters, bias), drawn at the offset it would have without drafts; min_tokens counts the rows
# before it, penalties count the drafts before it, logprobs come from each row; prompt logprobs are scored by
# the prompt's pass, before any decode carries drafts; a grammar masks each row after the drafts before it.

# Jump-forward asks once per request; the plain draw's gates are worked out once per request too
# (`_plain_gates`), as they are read for every row of every graphed decode step.
_JUMP_GATED = tuple(f for f in FEATURES if not f.jump_forward.allows(False))


def takes_plain_draw(state: SamplingState) -> bool:
    """Whether the row's token is the draw alone over its raw logits: every feature acting on it is one the
    plain draw applies or may skip (`Handling.allows`). A step whose every row does draws inside a CUDA graph
    (worker/graph_draw.py), with the tokens `Sampler.__call__` draws from the same logits."""
    gates = state.plain_draw_gates
    if gates is None:
        gates = state.plain_draw_gates = _plain_gates(state)
    for acts in gates:  # noqa: SIM110 - a loop, not any(): no generator made per row of every step
        if acts(state):
            return False
    return True


def _plain_gates(state: SamplingState) -> tuple[Callable[[SamplingState], bool], ...]:
    """The `acts` of each feature that can keep this request's rows off the plain draw: those its parameters
    ask for and the plain draw may not skip at its greediness. A feature acts only on rows that ask for it,
    so checking these few each step is checking them all."""
    greedy = state.greedy
    return tuple(f.acts for f in FEATURES if f.asked(state.params) and not f.plain_draw.allows(greedy))


def may_jump(params: SamplingParams) -> bool:
    """Whether a constrained request's forced tokens may be output without draws (jump-forward): every
    feature it asks for is one jump-forward applies or may skip."""
    greedy = params.greedy
    return not any(f.asked(params) and not f.jump_forward.allows(greedy) for f in _JUMP_GATED)


def may_chain(params: SamplingParams) -> bool:
    """Whether a request's drafted step may be chained on its step in flight (speculative decoding: planned
    as if that step accepts every draft, void if not): verification keeps it exact and nothing but the draw
    count carries from one draw to the next (no penalty counts, no grammar), so a void step is undone by
    giving its draws back."""
    return may_verify(params) and params.structured is None and not params.has_penalties


def may_verify(params: SamplingParams) -> bool:
    """Whether a request's decodes may carry drafts (speculative decoding) and still give exactly the tokens
    it gets without them: every feature it asks for is one verification applies or may skip."""
    greedy = params.greedy
    return not any(f.asked(params) and not f.verify.allows(greedy) for f in FEATURES)
