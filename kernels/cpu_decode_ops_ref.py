"""The specification of cpu_decode_ops.c in torch: what the CPU decode path (models/cpu_decode.py) computes with
eager ops between its projections. Outputs in float32; `as_planes` lays one out as the C code writes it
(bfloat16 copies side by side, the input of a projection packed in planes). Knows nothing of models."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def as_planes(x: torch.Tensor, planes: int) -> torch.Tensor:
    """x [T, N] float32 as an output of `planes` (0: float32 itself; else bfloat16 [T, planes * N])."""
    return x if planes == 0 else torch.cat([x.to(torch.bfloat16)] * planes, dim=-1)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, add: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the new residual, its norm) in float32: residual = x (+ residual), out = rms_norm(residual) * weight."""
    new = x.float() + residual if add else x.float()
    return new, F.rms_norm(new, (new.shape[-1],), weight, eps)


def rope_kv_write_ref(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
    bias: torch.Tensor | None,
    cos: torch.Tensor,  # [T, D / 2]
    sin: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
    num_heads: int,
    k_rows: torch.Tensor,  # [slots, Hkv, D], written
    v_rows: torch.Tensor,
) -> torch.Tensor:  # q [T, Hq, D] float32
    t = qkv.shape[0]
    hkv, d = k_rows.shape[1:]
    x = qkv.float() if bias is None else qkv.float() + bias
    qk = x[:, : (num_heads + hkv) * d].view(t, num_heads + hkv, d)
    x1, x2 = qk[..., : d // 2], qk[..., d // 2 :]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    k_rows[slots] = rotated[:, num_heads:]
    v_rows[slots] = x[:, (num_heads + hkv) * d :].view(t, hkv, d)
    return rotated[:, :num_heads]


def decode_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= T, max_blocks] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [T, Hq * D] float32
    t, hq, d = q.shape
    block_size, hkv = k_cache.shape[1:3]
    needed = -(-seq_len // block_size)
    blocks = block_tables[:t, :needed].long()
    keys = k_cache[blocks].reshape(t, -1, hkv, d)[:, :seq_len].repeat_interleave(hq // hkv, dim=2)  # [T, L, Hq, D]
    values = v_cache[blocks].reshape(t, -1, hkv, d)[:, :seq_len].repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("thd,tlhd->thl", q, keys) * scale
    return torch.einsum("thl,tlhd->thd", scores.softmax(dim=-1), values).reshape(t, hq * d)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] -> silu(gate) * up [T, I] in float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def quantize_rows_q8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float32 per 32 values: scale amax / 127 and codes round(x / scale) (ties to even), 0 where all 0."""
    t, k = x.shape
    groups = x.view(t, k // 32, 32)
    scale = groups.abs().amax(dim=-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return torch.round(groups * inv[..., None]).to(torch.int8).view(t, k), scale


def q8_head_ref(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[T, V] logits of x [T, K] against codes [V, K] int8 with scales [V, K / 32]: x quantized as above, each
    group's integer dot product exact, scaled by both scales (float64 here; the C code sums in float32)."""
    xq, sx = quantize_rows_q8_ref(x)
    v, k = codes.shape
    dots = torch.einsum("vgi,tgi->tvg", codes.view(v, k // 32, 32).double(), xq.view(-1, k // 32, 32).double())
    return (dots * scales.double()[None] * sx.double()[:, None, :]).sum(-1).float()
