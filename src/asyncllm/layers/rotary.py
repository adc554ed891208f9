"""Rotary position embeddings (rotate-half convention) with optional Llama 3.1 or linear frequency scaling.

Cos/sin tables are computed once in float32 the way transformers computes them per call, so indexing the
table gives bit-identical values; they are non-persistent buffers (never in a checkpoint) that follow
`model.to(...)`. The rotation itself is `asyncllm.kernels.rotary_ref.apply_rotary_ref`, the specification the
fused q/k kernel is held to. Knows nothing about attention or caches: positions come in, rotated q/k go out.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch
from torch import nn

from asyncllm.kernels.rotary_ref import apply_rotary_ref


class Llama3RopeScaling(Protocol):
    """What llama3 frequency scaling needs (models.config.Llama3RopeScaling provides it; layers never import
    models)."""

    @property
    def rope_type(self) -> Literal["llama3"]: ...
    @property
    def factor(self) -> float: ...
    @property
    def low_freq_factor(self) -> float: ...
    @property
    def high_freq_factor(self) -> float: ...
    @property
    def original_max_position_embeddings(self) -> int: ...


class LinearRopeScaling(Protocol):
    """Linear scaling (models.config.LinearRopeScaling): every frequency divided by `factor`."""

    @property
    def rope_type(self) -> Literal["linear"]: ...
    @property
    def factor(self) -> float: ...


RopeScaling = Llama3RopeScaling | LinearRopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies theta^(-2i/d), rescaled when asked (as transformers does:
    llama3's blend, or linear's `inv_freq /= factor`)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Long wavelengths are divided by `factor`, short ones kept, the band between blended smoothly."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables for positions [0, max_positions); forward looks up a batch of positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # Explicit float32 whatever the default dtype: the tables must not be built in bf16.
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos_cache.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] int64 positions -> (cos, sin), each [T, head_dim / 2] in the tables' dtype."""
        return self.cos_cache[positions], self.sin_cache[positions]


class RotaryInputs:
    """One forward pass's positions and the rotary tables, with the cos/sin lookup done at most once.

    Fused kernels read the tables at the positions themselves; the torch path asks for `lookup()`.
    """

    def __init__(self, positions: torch.Tensor, rotary: RotaryEmbedding) -> None:
        self.positions = positions  # [T] int64
        self.cos_cache: torch.Tensor = rotary.cos_cache  # [P, D/2] float32
        self.sin_cache: torch.Tensor = rotary.sin_cache
        self._rotary = rotary
        self._looked_up: tuple[torch.Tensor, torch.Tensor] | None = None

    def lookup(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, D/2], for the torch path; computed on first use and shared by every layer."""
        if self._looked_up is None:
            self._looked_up = self._rotary(self.positions)
        return self._looked_up


# The model's rotation is the specification itself (the fused q/k kernel is held to it).
apply_rotary = apply_rotary_ref
