"""The specification of `asyncllm.kernels.sampling`, in torch alone (no triton: CPU engines sample with it).

The noise is a counter-based hash of (seed, offset, token id) on uint32 lanes held in int64; these
functions reproduce the kernel's bits exactly, and `gumbel_argmax_ref` its choice (up to an ulp of `log`,
which can move only near-ties).
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B9
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's 32-bit finaliser constants
_MASK32 = 0xFFFFFFFF
_TO_UNIT = 5.9604644775390625e-08  # 2**-24


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for uint32 values held in int64, without overflowing int64 (16-bit halves)."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _MASK32


def _fmix32_ref(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _M1)
    h = h ^ (h >> 13)
    h = _mul32(h, _M2)
    return h ^ (h >> 16)


def uniform_noise_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32 uniforms in (0, 1): the kernel's draws, bit for bit."""
    key_lo = seeds & _MASK32
    key_hi = (seeds >> 32) & _MASK32
    counter = offsets & _MASK32
    row_key = _fmix32_ref(counter ^ _fmix32_ref(key_lo ^ _fmix32_ref(key_hi ^ _GOLDEN)))[:, None]  # [R, 1]
    cols = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    h = _fmix32_ref((_fmix32_ref(cols ^ row_key) + row_key) & _MASK32)
    return ((h >> 8).to(torch.float32) + 0.5) * _TO_UNIT


def gumbel_argmax_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """The specification: [R] int64 tokens, argmax(x / T - log(-log u)) per row, plain argmax where T = 0."""
    x = logits.float()
    noise = -torch.log(-torch.log(uniform_noise_ref(seeds, offsets, x.shape[1])))
    greedy = (temperature == 0.0)[:, None]
    safe_t = torch.where(greedy, torch.ones_like(temperature[:, None]), temperature[:, None])
    score = torch.where(greedy, x, x / safe_t + noise)
    return score.argmax(dim=-1)
