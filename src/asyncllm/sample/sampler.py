"""Turns one step's logits into next tokens: penalties, greedy or seeded random sampling, logprobs.

Everything happens in logit space: filters set logits to -inf and sampling is an argmax over logits plus
Gumbel noise drawn from each request's own generator, so a request's tokens depend only on its seed and
its own logits, never on the rest of the batch. Knows nothing of scheduling, the model or the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncllm.layers.host_copy import to_device
from asyncllm.sample.penalties import apply_penalties
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "apply_min_p", "apply_top_k_top_p"]

# Below this temperature logits / temperature overflows float32; the distribution is already its limit,
# the argmax, so such rows are sampled greedily (vLLM draws the same line).
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64, on the logits' device
    # Per row when any row asked for params.logprobs: {token: logprob} for the sampled token and the top
    # `logprobs` alternatives; None for rows that did not ask.
    logprobs: list[dict[int, float] | None] | None = None


class Sampler:
    """Stateless: every per-request input arrives in `states`, aligned with the rows of `logits`."""

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states) or not logits.is_floating_point():
            raise ValueError(
                f"Sampler: logits must be a float [num_states={len(states)}, vocab] tensor, "
                f"got {tuple(logits.shape)} {logits.dtype}"
            )
        # float() is a no-op on float32 input; nothing below writes into `x` in place.
        x = apply_penalties(_suppress_stops_before_min_tokens(logits.float(), states), states)  # [N, vocab]
        random_rows = [i for i, s in enumerate(states) if not _is_greedy(s.params)]
        if len(random_rows) == len(states):
            token_ids = _sample_random(x, states)
        else:
            token_ids = x.argmax(dim=-1)
            if random_rows:
                row_index = to_device(random_rows, torch.int64, x.device)
                sampled = _sample_random(x.index_select(0, row_index), [states[i] for i in random_rows])
                token_ids.index_copy_(0, row_index, sampled)
        logprobs = None
        if any(s.params.logprobs is not None for s in states):
            logprobs = _gather_logprobs(logits, token_ids, states)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _suppress_stops_before_min_tokens(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Until a request has `min_tokens` outputs its EOS and stop ids cannot be sampled (vLLM's rule), so a
    short answer is never padded with an end-of-text token it was not allowed to stop on."""
    rows: list[int] = []
    cols: list[int] = []
    for i, state in enumerate(states):
        if len(state.output_token_ids) < state.params.min_tokens and state.min_tokens_stop_ids:
            rows.extend([i] * len(state.min_tokens_stop_ids))
            cols.extend(state.min_tokens_stop_ids)
    if not rows:
        return logits
    vocab = logits.shape[1]
    keep = [(r, c) for r, c in zip(rows, cols) if c < vocab]
    out = logits.clone()
    if keep:
        r_idx = to_device([r for r, _ in keep], torch.int64, logits.device)
        c_idx = to_device([c for _, c in keep], torch.int64, logits.device)
        out[r_idx, c_idx] = float("-inf")
    return out


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_TEMPERATURE


def _sample_random(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """[R, vocab] float32 (not modified) -> [R] int64 tokens: temperature, top-k, top-p, min-p, sample."""
    device, vocab = logits.device, logits.shape[1]
    params = [s.params for s in states]
    temperature = to_device([p.temperature for p in params], torch.float32, device)
    x = logits / temperature.unsqueeze(1)  # a fresh tensor: the filters below may write into it

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab means "off"
    top_p = [p.top_p for p in params]
    k_rows = to_device(top_k, torch.int64, device) if any(v < vocab for v in top_k) else None
    p_rows = to_device(top_p, torch.float32, device) if any(v < 1.0 for v in top_p) else None
    if k_rows is not None or p_rows is not None:
        x = apply_top_k_top_p(x, k_rows, p_rows, max_k=max((v for v in top_k if v < vocab), default=None))
    min_p = [p.min_p for p in params]
    if any(v > 0.0 for v in min_p):
        x = apply_min_p(x, to_device(min_p, torch.float32, device))
    return _gumbel_argmax(x, [s.generator for s in states])


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_k: int | None = None
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, then outside its nucleus of mass top-p.

    logits: [R, vocab] float32, written into. top_k: [R] int64 in [1, vocab] (vocab: off). top_p: [R]
    float32 in (0, 1] (1: off). `max_k`, the largest k below vocab (known on the host), lets top-k alone
    avoid a full sort.
    Tokens tied with the k-th largest logit are all kept. The largest logit always survives.
    """
    vocab = logits.shape[1]
    if top_p is None:
        assert top_k is not None
        # Only each row's k-th largest value is needed: a partial top-k of the largest active k beats
        # sorting the vocabulary. Rows with top-k off get a -inf threshold.
        width = vocab if max_k is None else max_k
        kth = logits.topk(width, dim=-1).values.gather(1, top_k.clamp(max=width).unsqueeze(1) - 1)  # [R, 1]
        kth.masked_fill_(top_k.unsqueeze(1) >= vocab, float("-inf"))
        return logits.masked_fill_(logits < kth, float("-inf"))

    sorted_logits, order = logits.sort(dim=-1)  # ascending, so every filter keeps a suffix of each row
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))  # [R, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    # Drop the low tail whose total mass is <= 1 - p: what is left is the smallest set of mass >= p.
    # Rows with p == 1 get an unreachable cut, so tokens whose float32 probability underflows survive.
    cut = torch.where(top_p < 1.0, 1.0 - top_p, -1.0).unsqueeze(1)  # [R, 1]
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, vocab], ascending order
    drop = cumulative <= cut
    drop[:, -1] = False  # keep the most likely token even when rounding pushes the whole row under the cut
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p times the row's largest probability.

    logits: [R, vocab] float32, written into; min_p: [R] float32 in [0, 1] (0: off). In logit space
    p_i >= min_p * p_max is x_i >= x_max + log(min_p), so no probabilities are formed.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [R, 1]; log(0) = -inf: off
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _gumbel_argmax(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """[R, vocab] -> [R] int64, token i drawn with probability softmax(logits)[i].

    argmax(x - log E) with E ~ Exp(1) is a sample from softmax(x) (-log E is Gumbel noise). Each row's noise
    comes from its own generator, so rows never share random state.
    """
    noise = torch.empty_like(logits)  # [R, vocab]
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    # Exp(1) can return exactly 0 on some backends; log(0) would turn a masked -inf into NaN.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_()
    return (logits - noise).argmax(dim=-1)


def _gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, states: Sequence[SamplingState]
) -> list[dict[int, float] | None]:
    """log_softmax of the raw logits for rows that asked: the sampled token and the top-n alternatives.

    This is the one place the sampler syncs with the host, and only because the caller asked for values.
    """
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    row_index = to_device(rows, torch.int64, logits.device)
    logprobs = logits.index_select(0, row_index).float().log_softmax(dim=-1)  # [R, vocab]
    sampled = token_ids.index_select(0, row_index).unsqueeze(1)  # [R, 1]
    num_top = min(max(states[i].params.logprobs or 0 for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [R, num_top]
    # One device-to-host copy: ids ride along as float64, exact for any vocabulary size.
    parts = [sampled, logprobs.gather(1, sampled), top_ids, top_values]
    packed = torch.cat([part.to(torch.float64) for part in parts], dim=1)  # [R, 2 + 2 * num_top]
    result: list[dict[int, float] | None] = [None] * len(states)
    for row, values in zip(rows, packed.tolist()):
        n = states[row].params.logprobs or 0
        entry = {int(values[0]): values[1]}
        ids, lps = values[2 : 2 + num_top], values[2 + num_top :]
        for token, lp in zip(ids[:n], lps[:n]):
            entry.setdefault(int(token), lp)
        result[row] = entry
    return result
