"""`gumbel_argmax_cpu`: the draw of `sampling_ref.gumbel_argmax_ref` (the same tokens) for CPU engines, at a
fraction of its cost.

The reference hashes on int64 lanes, multiplying in 16-bit halves, over the whole [rows, vocab] at once:
about forty passes over 8 bytes a token, each a fresh tensor. Here the same hash runs on int32 lanes (a
wrapping int32 multiply keeps the low 32 bits, which is all the hash keeps), in place, over blocks of columns
that stay in cache. The uniforms are the reference's bit for bit and the noise and scores the same float32
ops, so the tokens are the reference's; greedy rows take a plain argmax without drawing noise.
Imports only torch (and the reference, for the row keys and the bitmask).
"""

from __future__ import annotations

import torch

from .sampling_ref import _GOLDEN, _M1, _M2, _MASK32, _TO_UNIT, check_token_bitmask, token_bitmask_allowed

_M1_I32, _M2_I32 = _M1 - 2**32, _M2 - 2**32  # the same 32 bits as int32 scalars
_BLOCK = 262144  # elements per op: int32 and float32 buffers of 256 KiB each, cache-resident


def _fmix32_(h: torch.Tensor, t: torch.Tensor) -> None:
    """murmur3's finaliser in place on int32 lanes (`t`: scratch of h's shape). An arithmetic shift then a
    mask is the logical shift; the multiplies wrap modulo 2**32 as the uint32 ones do."""
    for shift, mul in ((16, _M1_I32), (13, _M2_I32), (16, None)):
        torch.bitwise_right_shift(h, shift, out=t)
        t.bitwise_and_((1 << (32 - shift)) - 1)
        h.bitwise_xor_(t)
        if mul is not None:
            h.mul_(mul)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * _M1) & _MASK32
    h ^= h >> 13
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def _row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[R] int32: `uniform_noise_ref`'s per-row keys, in Python integers (R values: a few microseconds each,
    where torch would launch some sixty tiny ops)."""
    keys = []
    for seed, offset in zip(seeds.tolist(), offsets.tolist()):
        key = _fmix32_int(
            (offset & _MASK32) ^ _fmix32_int((seed & _MASK32) ^ _fmix32_int(((seed >> 32) & _MASK32) ^ _GOLDEN))
        )
        keys.append(key - 2**32 if key >= 2**31 else key)  # the int32 with the same bits
    return torch.tensor(keys, dtype=torch.int32)


def _draw_rows(x: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[R] int64: argmax over the columns of x / T - log(-log u), block by block, first maximum kept."""
    rows, vocab = x.shape
    width = min(vocab, max(1024, _BLOCK // max(rows, 1)))
    h = torch.empty(rows, width, dtype=torch.int32)
    t = torch.empty_like(h)
    best = torch.full((rows,), float("-inf"))
    best_at = torch.zeros(rows, dtype=torch.int64)
    cols = torch.arange(vocab, dtype=torch.int32)
    temp = temperature[:, None]
    key = keys[:, None]
    for start in range(0, vocab, width):
        w = min(width, vocab - start)
        hb, tb = h[:, :w], t[:, :w]
        torch.bitwise_xor(cols[start : start + w][None, :], key, out=hb)
        _fmix32_(hb, tb)
        hb.add_(key)  # (a + b) mod 2**32
        _fmix32_(hb, tb)
        torch.bitwise_right_shift(hb, 9, out=tb)
        u = tb.bitwise_and_(0x7FFFFF).to(torch.float32).add_(0.5).mul_(_TO_UNIT)  # the reference's uniforms
        score = x[:, start : start + w] / temp
        score.add_(u.log_().neg_().log_().neg_())  # x / T + (-log(-log u)), the reference's ops
        at = score.argmax(dim=1)  # NaN counts as the maximum, as in the reference's argmax
        value = score.gather(1, at[:, None])[:, 0]
        better = (value > best) | (value.isnan() & ~best.isnan())  # ties keep the earlier block's column
        best = torch.where(better, value, best)
        best_at = torch.where(better, at + start, best_at)
    return best_at


def gumbel_argmax_cpu(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gumbel_argmax_ref`'s tokens ([R] int64) on CPU tensors; same arguments, same contract (`out`: where
    they go, as the kernel's)."""
    tokens = _gumbel_argmax_cpu(logits, temperature, seeds, offsets, bitmask, mask_rows)
    return tokens if out is None else out.copy_(tokens)


def _gumbel_argmax_cpu(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    bitmask: torch.Tensor | None,
    mask_rows: torch.Tensor | None,
) -> torch.Tensor:
    x = logits.float()
    if (bitmask is None) != (mask_rows is None):
        raise ValueError("bitmask and mask_rows go together: pass both or neither")
    if bitmask is not None and mask_rows is not None:
        check_token_bitmask(bitmask, mask_rows, x.shape[0], x.shape[1], x.device)
        x = x.masked_fill(~token_bitmask_allowed(bitmask, mask_rows, x.shape[1]), float("-inf"))
    greedy = temperature == 0.0
    if bool(greedy.all()):
        return x.argmax(dim=-1)
    if not bool(greedy.any()):
        return _draw_rows(x, temperature, _row_keys(seeds, offsets))
    tokens = x.argmax(dim=-1)
    drawn = (~greedy).nonzero()[:, 0]
    keys = _row_keys(seeds.index_select(0, drawn), offsets.index_select(0, drawn))
    tokens[drawn] = _draw_rows(x.index_select(0, drawn), temperature.index_select(0, drawn), keys)
    return tokens
