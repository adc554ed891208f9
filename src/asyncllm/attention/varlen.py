"""Attention over packed variable-length sequences with no KV cache: an encoder's bidirectional attention
(BERT), or causal for a prefill-only pass. Owns `EncoderBatch`, one forward's layout of sequences, and
`VarlenAttention`, the layer: the torch twin (kernels/varlen_attention_ref.py) until `enable_fused_kernels`
switches it to the Triton kernel (kernels/varlen_attention.py). The worker does that exactly where it takes
the Triton attention backend (`attention_backend="triton"`, or "auto" on CUDA; `layers.fusion.use_fused_kernels`),
as for every fused layer, so `attention_backend="torch"` is the twin at run time. Knows no model, no paged
cache and no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from asyncllm.kernels.varlen_attention_ref import varlen_attention_ref
from asyncllm.layers.fusion import Fusable

__all__ = ["EncoderBatch", "VarlenAttention", "varlen_attention"]

# The Triton launcher's signature: (q, k, v, cu_seqlens, max_seqlen, scale, causal) -> [T, H, D]
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, bool], torch.Tensor]


@dataclass(frozen=True)
class EncoderBatch:
    """The sequences of one forward, packed: sequence i owns rows `cu_seqlens[i]:cu_seqlens[i + 1]` of every
    [T, ...] input. The host copies spare the twin and the launcher a device sync."""

    cu_seqlens: torch.Tensor  # [B + 1] int32 on the model's device: 0, then each sequence's end row
    seq_lens_cpu: list[int]  # [B], each >= 1
    max_seqlen: int  # max(seq_lens_cpu)

    def __post_init__(self) -> None:
        lens = self.seq_lens_cpu
        if not lens or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lens):
            raise ValueError(f"EncoderBatch.seq_lens_cpu={lens!r} must hold one int >= 1 per sequence")
        if self.max_seqlen != max(lens):
            raise ValueError(f"EncoderBatch.max_seqlen={self.max_seqlen!r} must equal max(seq_lens_cpu)={max(lens)}")
        cu = self.cu_seqlens
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] != len(lens) + 1:
            raise ValueError(
                f"EncoderBatch.cu_seqlens must be int32 [B + 1] = [{len(lens) + 1}]; got {cu.dtype} {tuple(cu.shape)}"
            )

    @classmethod
    def from_seq_lens(cls, seq_lens: Sequence[int], device: torch.device | str) -> EncoderBatch:
        """The batch of sequences of these lengths, packed in this order (one host-to-device copy)."""
        lens = list(seq_lens)
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        cu = torch.tensor(offsets, dtype=torch.int32).to(device)
        return cls(cu, lens, max(lens, default=0))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens_cpu)

    @property
    def first_rows_cpu(self) -> list[int]:
        """Each sequence's first row (its [CLS] token in a BERT batch), on the host."""
        rows = [0]
        for n in self.seq_lens_cpu[:-1]:
            rows.append(rows[-1] + n)
        return rows


def varlen_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]; Hkv divides H
    v: torch.Tensor,  # [T, Hkv, D]
    batch: EncoderBatch,
    scale: float,
    causal: bool,
    kernel: VarlenKernel | None = None,  # the Triton launcher; None: the torch twin
) -> torch.Tensor:  # [T, H, D]
    """Each query over its own sequence's keys: all of them, or with `causal` those at or before it."""
    if q.shape[0] != batch.num_tokens:
        raise ValueError(f"q has {q.shape[0]} rows but the batch's sequences hold {batch.num_tokens} tokens")
    if kernel is None:
        return varlen_attention_ref(q, k, v, batch.seq_lens_cpu, scale, causal)
    return kernel(q, k, v, batch.cu_seqlens, batch.max_seqlen, scale, causal)


class VarlenAttention(nn.Module, Fusable):
    """The attention op of an encoder layer: q/k/v of packed sequences in, [T, H * D] out. Owns head
    bookkeeping, the softmax scale and the causal flag; no parameters, no cache."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool = False,  # False: bidirectional (an encoder's)
        scale: float | None = None,  # None: head_dim ** -0.5
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal = causal
        self.scale = head_dim**-0.5 if scale is None else scale
        self._kernel: VarlenKernel | None = None  # the Triton launcher, once enable_fused_kernels ran

    @property
    def fused(self) -> bool:
        """Whether the Triton kernel is on."""
        return self._kernel is not None

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.varlen_attention import varlen_attention as kernel

        self._kernel = kernel

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        batch: EncoderBatch,
    ) -> torch.Tensor:  # [T, H * D]
        out = varlen_attention(q, k, v, batch, self.scale, self.causal, self._kernel)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"causal={self.causal}, fused={self.fused}"
        )
