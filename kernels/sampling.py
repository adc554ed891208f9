"""Seeded sampling: argmax over each row of logits / temperature plus Gumbel noise, in two launches.

Row r draws token i with probability softmax(logits[r] / T_r)[i]: argmax(x / T - log(-log u)) with u uniform
is a sample from that softmax. The noise is a pure function of (seed_r, offset_r, i) through a counter-based
hash, so a request's draws depend only on its own seed and how many it has drawn (`offset`), never on the
batch it shares. T_r = 0 rows take the plain argmax. `gumbel_argmax_ref` is the specification in torch,
in sampling_ref.py (identical noise bits; the kernel's log may differ from torch's by an ulp, moving only
near-ties). Structured output: an optional token bitmask (xgrammar's int32 layout) makes disallowed tokens
score -inf inside the same launch; a compile-time flag keeps the unconstrained variant free of its loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling_ref import apply_token_bitmask_ref, check_token_bitmask, gumbel_argmax_ref, uniform_noise_ref

__all__ = ["apply_token_bitmask_ref", "gumbel_argmax", "gumbel_argmax_ref", "uniform_noise_ref"]

BLOCK_V = 1024  # vocabulary columns per tile
MAX_SPLITS = 256  # splits per row: the reduction's fixed width (one compiled variant for any count)
# Launch shape, from bench/kernels/bench_sampling.py on the H200 (bfloat16, 151,936 columns): 32 programs per
# SM and 8 warps took 256 rows from 297 to 133 us, 64 rows from 73 to 39, one row from 6.7 to 5.6. The
# noise's hashing and logarithms bound it (14 % of copy bandwidth), so many programs in flight hide latency.
PROGRAMS_PER_SM = 32  # (row, split) programs per SM a launch aims for
NUM_WARPS = 8


@triton.jit
def _fmix32(h):
    """murmur3's finaliser on uint32 lanes (multiplications wrap mod 2**32)."""
    h ^= h >> 16
    h *= 0x85EBCA6B  # sampling_ref._M1
    h ^= h >> 13
    h *= 0xC2B2AE35  # sampling_ref._M2
    h ^= h >> 16
    return h


@triton.jit(do_not_specialize=["vocab", "chunk", "num_masks", "mask_stride"])
def _gumbel_partial_kernel(
    logits_ptr, temp_ptr, seed_ptr, offset_ptr, part_val_ptr, part_idx_ptr, vocab, stride_row, chunk,
    bitmask_ptr, mask_rows_ptr, num_masks, mask_stride,
    MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """Program (row, split): the best score and its first column within columns [split * chunk, ...).
    With HAS_MASK, token t is kept only if bit t % 32 of word t // 32 of the row's bitmask row is set."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    temperature = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row)  # int64 folded into two uint32 words
    key_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    key_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    counter = (tl.load(offset_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    row_key = _fmix32(counter ^ _fmix32(key_lo ^ _fmix32(key_hi ^ 0x9E3779B9)))
    greedy = temperature == 0.0
    safe_t = tl.where(greedy, 1.0, temperature)  # greedy rows never divide (by zero)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    if HAS_MASK:
        mask_row = tl.load(mask_rows_ptr + row).to(tl.int64)  # -1: unconstrained
        # Unconstrained rows read no word and see all bits set. A row index past the bitmask (unchecked on
        # CUDA, where reading mask_rows would wait for the device) reads nothing and allows nothing.
        words_hi = tl.where((mask_row >= 0) & (mask_row < num_masks), hi, 0)  # columns whose words are read
        words_other = tl.where(mask_row < 0, -1, 0)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hi
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        h = _fmix32(_fmix32(cols.to(tl.uint32) ^ row_key) + row_key)
        # (0, 1): 23 random bits. Never 1: with 24 bits the top value, 2**24 - 0.5, rounds to 2**24 in float32,
        # u became 1.0 and that column's noise +inf (a random token won ~1 % of draws over a 150k vocabulary).
        u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        noise = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x / safe_t + noise)
        score = tl.where(mask, score, float("-inf"))
        if HAS_MASK:
            # 32 lanes share a word: a warp's tile needs one 32-byte sector of the bitmask.
            word_ptrs = bitmask_ptr + mask_row * mask_stride + (cols >> 5)
            words = tl.load(word_ptrs, mask=cols < words_hi, other=words_other)
            score = tl.where(((words >> (cols & 31)) & 1) != 0, score, float("-inf"))
        better = score > best  # strict: the first column of a tie wins, as in torch.argmax
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    # Lowest column among the lanes holding the maximum (each lane already kept its own first).
    winner = tl.min(tl.where(best == top, best_idx, vocab), axis=0)
    tl.store(part_val_ptr + row * MAX_SPLITS + split, top)
    tl.store(part_idx_ptr + row * MAX_SPLITS + split, winner)


@triton.jit(do_not_specialize=["num_splits"])
def _argmax_reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_splits, MAX_SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, MAX_SPLITS)
    mask = offs < num_splits
    val = tl.load(part_val_ptr + row * MAX_SPLITS + offs, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * MAX_SPLITS + offs, mask=mask, other=2**31 - 1)
    top = tl.max(val, axis=0)
    # Splits cover increasing columns: the lowest column among those holding the maximum is the first.
    tl.store(out_ptr + row, tl.min(tl.where(val == top, idx, 2**31 - 1), axis=0).to(tl.int64))


def num_vocab_splits(
    rows: int, vocab: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM, block_v: int = BLOCK_V
) -> int:
    """Enough (row, split) programs for `programs_per_sm` per SM, each at least one tile wide."""
    return max(1, min(MAX_SPLITS, -(-programs_per_sm * num_sms // max(rows, 1)), -(-vocab // block_v)))


def gumbel_argmax(
    logits: torch.Tensor,  # [R, vocab] float32/bfloat16/float16, rows may be strided
    temperature: torch.Tensor,  # [R] float32; 0 = greedy
    seeds: torch.Tensor,  # [R] int64
    offsets: torch.Tensor,  # [R] int64: draws this request made before (< 2**32)
    bitmask: torch.Tensor | None = None,  # [M, W >= ceil(vocab / 32)] int32, xgrammar's token bitmask
    mask_rows: torch.Tensor | None = None,  # [R] int32/int64: each row's bitmask row, -1 = unconstrained
    out: torch.Tensor | None = None,  # [R] int64
    num_splits: int | None = None,  # vocabulary splits per row; None: enough to fill the GPU
    *,
    programs_per_sm: int = PROGRAMS_PER_SM,  # launch shape, for the benchmark's sweep
    block_v: int = BLOCK_V,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Each row's vocabulary is split across programs (a batch of one row still fills the GPU), each
    keeping its best column; a second launch takes the first column of the best score. Tokens a row's
    bitmask disallows are never chosen (greedy rows included); a row whose bitmask allows nothing returns
    token 0, which the caller must treat as a grammar error. Without a bitmask the launch is today's."""
    _check(logits, temperature, seeds, offsets)
    rows, vocab = logits.shape
    if (bitmask is None) != (mask_rows is None):
        raise ValueError("bitmask and mask_rows go together: pass both or neither")
    # Without a bitmask its four arguments are None (constexpr): today's kernel, parameters included.
    num_masks, mask_stride = None, None
    if bitmask is not None and mask_rows is not None:
        check_token_bitmask(bitmask, mask_rows, rows, vocab, logits.device)
        num_masks, mask_stride = bitmask.shape[0], bitmask.stride(0)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    if num_splits is None:
        num_splits = num_vocab_splits(rows, vocab, _num_sms(logits.device), programs_per_sm, block_v)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} must be in [1, {MAX_SPLITS}]")
    chunk = triton.cdiv(triton.cdiv(vocab, num_splits), block_v) * block_v  # whole tiles per split
    num_splits = triton.cdiv(vocab, chunk)  # no empty split
    part_val = torch.empty(rows, MAX_SPLITS, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, MAX_SPLITS, dtype=torch.int32, device=logits.device)
    _gumbel_partial_kernel[(rows, num_splits)](
        logits, temperature, seeds, offsets, part_val, part_idx, vocab, logits.stride(0), chunk,
        bitmask, mask_rows, num_masks, mask_stride,
        MAX_SPLITS=MAX_SPLITS, BLOCK=block_v, HAS_MASK=bitmask is not None, num_warps=num_warps,
    )  # fmt: skip
    _argmax_reduce_kernel[(rows,)](part_val, part_idx, out, num_splits, MAX_SPLITS=MAX_SPLITS, num_warps=4)
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, enough to exercise the reduction
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _check(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be [R, vocab] with unit column stride; got {tuple(logits.shape)} {logits.stride()}"
        )
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"logits dtype {logits.dtype} is not supported; use float32, float16 or bfloat16")
    rows = logits.shape[0]
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("seeds", seeds, torch.int64),
        ("offsets", offsets, torch.int64),
    ):
        if t.shape != (rows,) or t.dtype != dtype or t.device != logits.device or (rows and t.stride(0) != 1):
            raise ValueError(
                f"{name} must be contiguous [{rows}] {dtype} on {logits.device}; got {tuple(t.shape)} {t.dtype} "
                f"on {t.device} with stride {t.stride()}"
            )
