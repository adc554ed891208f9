"""The specification of attention over packed variable-length sequences without a KV cache, in pure PyTorch:
the torch twin `attention/varlen.py` runs (an encoder's forward on CPU, and wherever the fused kernels are off)
and the Triton kernel (`varlen_attention.py`) is tested against.

Sequence i owns rows `starts[i]:starts[i] + seq_lens[i]` of q, k and v; each query attends to its own
sequence's keys only: all of them (bidirectional, an encoder's), or those at or before its position
(`causal`). Explicit float32 softmax, one sequence at a time. Imports only torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def varlen_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]; Hkv divides H: query head h reads KV head h // (H // Hkv)
    v: torch.Tensor,  # [T, Hkv, D]
    seq_lens: Sequence[int],  # each packed sequence's length, in row order; they sum to T
    scale: float,
    causal: bool,
) -> torch.Tensor:  # [T, H, D] in q's dtype
    num_tokens, num_heads, _ = q.shape
    if sum(seq_lens) != num_tokens or any(n < 1 for n in seq_lens):
        raise ValueError(f"seq_lens {list(seq_lens)} must be >= 1 each and sum to the {num_tokens} rows of q")
    group = num_heads // k.shape[1]
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        qf = q[rows].float().transpose(0, 1)  # [H, n, D]
        kf = k[rows].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        vf = v[rows].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, n, n]
        if causal:
            later = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)  # key after query
            scores = scores.masked_fill(later, float("-inf"))
        out[rows] = torch.matmul(torch.softmax(scores, dim=-1), vf).transpose(0, 1).to(q.dtype)
        start += n
    return out
