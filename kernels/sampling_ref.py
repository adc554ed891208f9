"""The specification of `asyncllm.kernels.sampling`, in torch alone (no triton: CPU engines sample with it).

The noise is a counter-based hash of (seed, offset, token id) on uint32 lanes held in int64; these
functions reproduce the kernel's bits exactly, and `gumbel_argmax_ref` its choice (up to an ulp of `log`,
which can move only near-ties). Token bitmasks (structured output) are xgrammar's layout: int32 words
[M, W], bit t % 32 of word t // 32 set = token t allowed; `mask_rows` maps each logits row to its bitmask
row, or -1 for an unconstrained row.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B9
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's 32-bit finaliser constants
_MASK32 = 0xFFFFFFFF
_TO_UNIT = 1.1920928955078125e-07  # 2**-23: 23 bits + 0.5 stay below 1 in float32 (24 bits rounded up to 1)


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
    return ((h >> 9).to(torch.float32) + 0.5) * _TO_UNIT


def check_token_bitmask(
    bitmask: torch.Tensor, mask_rows: torch.Tensor, rows: int, vocab: int, device: torch.device
) -> None:
    """ValueError naming the argument unless `bitmask` [M >= 1, W >= ceil(vocab / 32)] int32 (unit column
    stride) and `mask_rows` [rows] contiguous int32/int64 in [-1, M) are on `device`. The values are read only
    on the CPU: on CUDA that would wait for the device every step (the kernel then treats a row index >= M as
    allowing nothing, and never reads past the bitmask)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device != device:
        raise ValueError(
            f"bitmask must be a 2-d int32 tensor on {device} (xgrammar.allocate_token_bitmask); got "
            f"{tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device}"
        )
    num_masks, words = bitmask.shape
    if num_masks < 1 or words * 32 < vocab or bitmask.stride(1) != 1:
        raise ValueError(
            f"bitmask must be [M >= 1, W >= {-(-vocab // 32)}] (32 tokens a word over a vocabulary of {vocab}) "
            f"with unit column stride; got {tuple(bitmask.shape)} with stride {bitmask.stride()} (pass "
            "bitmask=None when no row is constrained)"
        )
    if (
        mask_rows.dtype not in (torch.int32, torch.int64)
        or mask_rows.shape != (rows,)
        or mask_rows.device != device
        or (rows and mask_rows.stride(0) != 1)
    ):
        raise ValueError(
            f"mask_rows must be contiguous [{rows}] int32 or int64 on {device} (one bitmask row or -1 per "
            f"logits row); got {tuple(mask_rows.shape)} {mask_rows.dtype} on {mask_rows.device} with stride "
            f"{mask_rows.stride()}"
        )
    if device.type == "cpu" and rows:
        low, high = int(mask_rows.min()), int(mask_rows.max())
        if low < -1 or high >= num_masks:
            raise ValueError(f"mask_rows values must be in [-1, {num_masks}) (bitmask rows); got [{low}, {high}]")


def token_bitmask_allowed(bitmask: torch.Tensor, mask_rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool: token t of row r is allowed. Rows with mask_rows < 0 allow everything, rows past the
    bitmask nothing (as the kernel). Bits past `vocab` in the last words are ignored. No device sync."""
    num_masks = bitmask.shape[0]
    unconstrained = mask_rows < 0
    in_range = ~unconstrained & (mask_rows < num_masks)
    words = bitmask.index_select(0, torch.where(in_range, mask_rows, 0))  # [R, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)[:, :vocab]  # [R, vocab]
    return ((bits != 0) & in_range[:, None]) | unconstrained[:, None]


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor) -> None:
    """Writes -inf, in place, into `logits` [R, vocab] (float) where row r's bitmask row mask_rows[r]
    disallows the token; rows with mask_rows[r] = -1 are left alone. For rows filtered (top-k/p, min-p)
    before the draw, and for engines sampling with `gumbel_argmax_ref`."""
    check_token_bitmask(bitmask, mask_rows, logits.shape[0], logits.shape[1], logits.device)
    logits.masked_fill_(~token_bitmask_allowed(bitmask, mask_rows, logits.shape[1]), float("-inf"))


def gumbel_argmax_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The specification: [R] int64 tokens, argmax(x / T - log(-log u)) per row, plain argmax where T = 0.
    With a token bitmask, disallowed tokens score -inf first (`apply_token_bitmask_ref` on a float copy);
    a row left with nothing (no allowed token, or only -inf logits among them) returns token 0, which the
    caller must treat as a grammar error. `out`: [R] int64 the tokens are written to (and returned)."""
    x = logits.float()
    if (bitmask is None) != (mask_rows is None):
        raise ValueError("bitmask and mask_rows go together: pass both or neither")
    if bitmask is not None and mask_rows is not None:
        check_token_bitmask(bitmask, mask_rows, x.shape[0], x.shape[1], x.device)
        x = x.masked_fill(~token_bitmask_allowed(bitmask, mask_rows, x.shape[1]), float("-inf"))
    noise = -torch.log(-torch.log(uniform_noise_ref(seeds, offsets, x.shape[1])))
    greedy = (temperature == 0.0)[:, None]
    safe_t = torch.where(greedy, torch.ones_like(temperature[:, None]), temperature[:, None])
    score = torch.where(greedy, x, x / safe_t + noise)
    tokens = score.argmax(dim=-1)
    return tokens if out is None else out.copy_(tokens)
