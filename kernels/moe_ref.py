"""The specification of a sparse mixture-of-experts MLP (Qwen3-MoE's), in pure PyTorch: top-k routing over a
router's logits, the SiLU-gated experts each token is routed to, weighted and summed; and the grouping of
routed rows by expert that the Triton kernel (`fused_moe.py`) runs its grouped GEMMs over. The layer's torch
path (`layers/moe.py`) calls it; the kernel is tested against it. Imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .silu_mul_ref import silu_and_mul_ref


def route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, K] in the logits' dtype, expert ids [T, K] int64), transformers'
    Qwen3-MoE router: softmax in float32, the top k, rescaled to sum to 1 when `renormalize` (the config's
    `norm_topk_prob`), then rounded to the logits' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K], x's dtype
    ids: torch.Tensor,  # [T, K] int64
) -> torch.Tensor:  # [T, H]
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, k]: transformers' loop, expert
    by expert in ascending order, each one's rows added into a zero output in x's dtype (its roundings too).
    An expert's rows go in transformers' order too, slot-major (all of slot 0's tokens, then slot 1's): a CPU
    GEMM may round a row differently at another position in the batch (a tail of the kernel's row tile)."""
    out = torch.zeros_like(x)
    by_slot = ids.t()  # [K, T]: where() walks it slot-major
    for expert in ids.unique().tolist():  # ascending; experts no token chose are skipped
        slot, token = torch.where(by_slot == expert)
        h = silu_and_mul_ref(F.linear(x[token], w13[expert]))  # [n, I]
        y = F.linear(h, w2[expert]) * weights[token, slot, None]  # [n, H]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def padded_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most rows `align_ref` can produce: each of the at most min(slots, experts) experts that receive a
    row pads its group by fewer than `block_m`. A multiple of `block_m`."""
    rows = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_ref(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed rows ("slots": s = t * K + k for ids [T, K]) grouped by expert for a grouped GEMM in blocks of
    `block_m` rows. Returns, sized by `padded_capacity` (shapes depend only on T, K, E and block_m):

    - sorted_slots [capacity] int32: expert 0's slots in ascending order, padded with T * K ("no row") to a
      multiple of block_m, then expert 1's, and so on; experts with no slot take no room; T * K after the end;
    - block_experts [capacity / block_m] int32: the expert of each block's rows, -1 past the last block used;
    - num_rows [1] int32: the rows used (the sum of the padded groups).
    """
    num_slots = ids.numel()
    capacity = padded_capacity(num_slots, num_experts, block_m)
    flat = ids.reshape(-1)
    sorted_slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=ids.device)
    block_experts = torch.full((capacity // block_m,), -1, dtype=torch.int32, device=ids.device)
    start = 0
    for expert in range(num_experts):
        slots = torch.nonzero(flat == expert).flatten()  # ascending
        if slots.numel() == 0:
            continue
        sorted_slots[start : start + slots.numel()] = slots.to(torch.int32)
        blocks = -(-slots.numel() // block_m)
        block_experts[start // block_m : start // block_m + blocks] = expert
        start += blocks * block_m
    return sorted_slots, block_experts, torch.tensor([start], dtype=torch.int32, device=ids.device)
