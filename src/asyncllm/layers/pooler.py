"""Pooling maths: a step's hidden states into one vector per sequence, embeddings' normalisation and
Matryoshka truncation, and the two ways a score engine turns a sequence into a relevance score.

sentence-transformers' `models/Pooling.py` (lasttoken, mean, cls) and `models/Normalize.py` are the
reference; the Qwen3-Reranker's yes/no score is its model card's. Pure PyTorch in float32 (the work is a
few rows per sequence: there is no faster twin to keep). Knows nothing of requests or of the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from asyncllm.pooling import PoolingMethod, PoolingParams


def pool(hidden: torch.Tensor, seq_lens: Sequence[int], method: PoolingMethod) -> torch.Tensor:
    """hidden [T, H], the sequences' rows packed in order (`seq_lens` of them each) -> [B, H] float32."""
    device = hidden.device
    if method is PoolingMethod.MEAN:
        lens = torch.tensor(seq_lens, device=device)
        owner = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)  # [T] row -> sequence
        sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, owner, hidden[: owner.shape[0]].float())
        return sums / lens[:, None].float()
    return hidden[row_indices(seq_lens, method, device)].float()


def row_indices(seq_lens: Sequence[int], method: PoolingMethod, device: torch.device) -> torch.Tensor:
    """[B] int64: the row each sequence pools from (its first for CLS, its last otherwise)."""
    rows, start = [], 0
    for n in seq_lens:
        rows.append(start if method is PoolingMethod.CLS else start + n - 1)
        start += n
    return torch.tensor(rows, dtype=torch.int64, device=device)


def finish_embeddings(pooled: torch.Tensor, normalizes: bool, params: Sequence[PoolingParams]) -> torch.Tensor:
    """pooled [B, H] float32 -> [B, H] float32 whose row i holds request i's embedding in its first
    `params[i].dimensions` values (the rest are left as they are). As sentence-transformers: the model's own
    Normalize module first (`normalizes`), then the Matryoshka cut; a request asking to `normalize` gets the
    cut renormalised (a unit vector of the length it asked for)."""
    out = F.normalize(pooled, dim=-1) if normalizes else pooled.clone()
    width = pooled.shape[1]
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, p in enumerate(params):
        if p.normalize:
            groups.setdefault((p.dimensions or width, True), []).append(i)
    for (dims, _), rows in groups.items():
        if dims == width and normalizes:
            continue  # unit vectors already
        index = torch.tensor(rows, dtype=torch.int64, device=pooled.device)
        out[index, :dims] = F.normalize(out[index, :dims], dim=-1)
    return out


def yes_no_scores(logits: torch.Tensor, no_id: int, yes_id: int) -> torch.Tensor:
    """logits [B, V] at each sequence's last position -> [B] float32: P("yes") under the softmax over the "no"
    and "yes" logits alone (the Qwen3-Reranker's score: log_softmax over the pair, then exp of "yes")."""
    pair = torch.stack([logits[:, no_id], logits[:, yes_id]], dim=1).float()  # [B, 2]
    return torch.log_softmax(pair, dim=1)[:, 1].exp()


def classifier_scores(logits: torch.Tensor) -> torch.Tensor:
    """A cross-encoder's logits [B, 1] -> [B] float32: the sigmoid of its one logit (sentence-transformers'
    CrossEncoder with one label)."""
    return torch.sigmoid(logits[:, 0].float())
