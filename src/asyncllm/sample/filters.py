"""top-k, top-p and min-p as masks on temperature-scaled logits (filtered tokens become -inf).

Knows nothing of requests or noise: rows of logits and per-row parameters in, masked rows out.
"""

from __future__ import annotations

import torch


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
