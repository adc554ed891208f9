"""The specification of the persistent decode layer (`decode_layer.py`), in pure PyTorch: the Llama/Qwen3 decoder
layer's steps for one decode token per row, composed from the references the separate kernels are tested
against (RMSNorm, F.linear in float32 rounded once, q/k norm + rotary + KV store, paged attention,
SiLU-and-mul). Imports only torch and the sibling references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .paged_attention_ref import paged_attention_ref
from .qk_norm_rope_kv_ref import qk_norm_rope_kv_ref
from .rms_norm_ref import rms_norm_ref
from .silu_mul_ref import silu_and_mul_ref


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One decoder layer's weights in the [out, in] layout, all of the activations' dtype."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 Hkv) D, hidden]: q, k, v packed
    q_norm: torch.Tensor | None  # [D]: Qwen3's per-head norms; None: Llama (none)
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [hidden, H D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 I, hidden]: gate, then up
    down: torch.Tensor  # [hidden, I]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float()).to(x.dtype)  # the GEMV's contract: float32 sums, rounded once


def decode_layer_ref(
    x: torch.Tensor,  # [R, hidden]: the previous layer's output (the embedding for layer 0)
    residual: torch.Tensor | None,  # [R, hidden]: the residual stream before it; None for layer 0
    w: DecodeLayerWeights,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]; this step's keys and values are stored
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [R] int64
    cos_cache: torch.Tensor,  # [max_positions, D / 2]
    sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [R] int64; -1: no store
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: list[int],  # each row's length with its new token; 0: a padding row (its outputs are unspecified)
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the MLP's output, the residual stream before it), as LlamaDecoderLayer returns them."""
    h0 = x if residual is None else x + residual
    qkv = _linear(rms_norm_ref(h0, w.input_norm, w.eps), w.qkv)
    q = qk_norm_rope_kv_ref(
        qkv, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, w.q_norm, w.k_norm, w.eps
    )  # [R, H, D]
    attn = torch.zeros_like(q)
    live = [i for i, n in enumerate(seq_lens) if n > 0]
    if live:
        index = torch.tensor(live)
        attn[index] = paged_attention_ref(
            q[index], k_cache, v_cache, block_tables[index], [1] * len(live), [seq_lens[i] for i in live], scale
        )
    h1 = _linear(attn.flatten(1), w.o) + h0
    gate_up = _linear(rms_norm_ref(h1, w.post_norm, w.eps), w.gate_up)
    return _linear(silu_and_mul_ref(gate_up), w.down), h1
