"""Paged attention in Triton: split-KV decode ("flash-decoding") and a varlen causal prefill forward.
A decode launch of one split (a full batch fills the GPU without splitting) normalises and writes its output
in the split kernel; more splits leave partials that a second launch merges, or, given `counters` (a zeroed
int32 workspace the caller keeps), the split kernel merges them itself: the last split of each sequence and
KV head to finish (paged_attention_fold.py), one launch. The second launch stays the simple twin (and
cascade decode's merge).

Both read keys/values through each sequence's block table, token by token, so any power-of-two block size
works. A sliding-window layer (`window` given) reads only the keys inside its queries' windows: a decode
program walks the last `window` keys, a prefill tile starts at its first row's window (a constexpr switch, so
global layers run the kernels they always ran). `paged_attention_ref` (paged_attention_ref.py) is the
specification, in pure PyTorch. Knows nothing of the engine: the caller hands in packed queries, the cache,
and the per-step plans (paged_attention_plan.py, re-exported here: `plan_prefill_tiles`, `tile_buffer`,
`choose_num_splits`). The kernels themselves are in paged_attention_kernels.py; this module is their launch
contract: checks, launch configuration, the grids.

Cascade decode (`cascade`, global layers): sequences whose block tables begin with the same blocks (a shared
prompt prefix, kernels/cascade_plan.py) are grouped in units; one program per (KV head, unit, prefix split)
reads the prefix once for all members' queries (paged_attention_cascade.py), the decode kernel walks each
member's keys after it, and the reduction merges both by their log-sum-exp: the same softmax over every key.

An FP8 cache (float8_e4m3fn, `kv_cache_dtype="fp8"`) is read as its codes times `k_scale` / `v_scale`,
float32 tensors of one element (kv_cache_fp8_ref.py); a cache in the queries' dtype takes none.

Both kernels also run inside CUDA graphs whose launch shapes are fixed for any step of up to N tokens: a
decode entry of -1 is no work (its programs exit at once), and prefill programs walk the tiles with a
stride, up to a live count read on the device (`TILES_HEADER`), so a fixed grid covers any tile count.
"""

from __future__ import annotations

import torch
import triton

from .cascade_plan import UNIT_FIELDS, Cascade
from .paged_attention_cascade import _cascade_prefix_kernel
from .paged_attention_checks import check_inputs, check_kv_scales, check_window
from .paged_attention_kernels import _decode_reduce_kernel, _decode_split_kernel, _prefill_kernel
from .paged_attention_plan import (
    MAX_SPLITS,
    TILES_HEADER,
    choose_num_splits,
    max_prefill_tiles,
    plan_prefill_tiles,
    prefill_block_m,
    tile_buffer,
)
from .paged_attention_ref import paged_attention_ref
from .pdl import pdl_launch

__all__ = [
    "TILES_HEADER",
    "Cascade",
    "choose_num_splits",
    "max_prefill_tiles",
    "paged_attention_ref",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_prefill_tiles",
    "prefill_block_m",
    "runs_in_interpreter",
    "tile_buffer",
]

_LOG2E = 1.4426950408889634


def runs_in_interpreter() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_prefill_kernel).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------------------------------------- launchers
def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # no TF32 rounding for float32 inputs


def _scale_pointers(
    q: torch.Tensor, kv_fp8: bool, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' scale arguments: an FP8 cache's scales; otherwise q twice (never read, and always of q's
    type, so a cache in the queries' dtype compiles one variant whatever scales a caller passes)."""
    if kv_fp8:
        assert k_scale is not None and v_scale is not None
        return k_scale, v_scale
    return q, q


def paged_decode_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    decode_seqs: torch.Tensor,  # [Bd] int32: the batch index of each single-query sequence; -1: none (padding).
    # Programs start in this order: longest first keeps the last wave short (the caller's planning).
    out: torch.Tensor,  # [T, H, D]: only the rows of decode_seqs are written
    scale: float,
    num_splits: int,  # KV splits per sequence; each sequence divides its own length (read on the device)
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
    window: int | None = None,  # a sliding window: each query reads its last `window` keys; None: all
    k_scale: torch.Tensor | None = None,  # an FP8 cache's scales: float32, one element each, on q's device
    v_scale: torch.Tensor | None = None,
    cascade: Cascade | None = None,  # shared prefixes read once per unit (global attention only)
    # The folded reduce's tickets: int32, contiguous, at least len(decode_seqs) x Hkv, zero (each launch leaves
    # them zero; launches that share them must run one after another, as a stream's do). None: a reduce launch.
    counters: torch.Tensor | None = None,
    pdl: bool = False,  # the split kernel launched as a programmatic dependent (CUDA, Hopper or newer: kernels/pdl.py)
) -> None:
    group, head_dim, block_size = check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    check_window(window)
    kv_fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    prefix_splits = 0 if cascade is None else _check_cascade(cascade, decode_seqs, window, num_splits, group)
    if num_stages is None:
        # Two stages: half the shared memory of four, so an SM holds more programs, which beats a deeper
        # pipeline once lengths vary (H200, batch 256, lengths U[200, 2048], longest first: 0.372 against
        # 0.387 ms; bench/RESULTS.md run 19).
        num_stages = 2
    if decode_seqs.dtype != torch.int32 or decode_seqs.dim() != 1:
        raise TypeError(f"decode_seqs must be 1-D int32; got {decode_seqs.dtype} {tuple(decode_seqs.shape)}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} must be in [1, {MAX_SPLITS}]")
    num_decode, num_heads, num_kv_heads = decode_seqs.shape[0], q.shape[1], k_cache.shape[2]
    if num_decode == 0:
        return
    if counters is not None:
        _check_counters(counters, num_decode * num_kv_heads, q.device, cascade)
    fold = counters is not None and num_splits > 1
    parts = num_splits + prefix_splits
    acc = torch.empty(num_decode, num_heads, parts, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(num_decode, num_heads, parts, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    scales = _scale_pointers(q, kv_fp8, k_scale, v_scale)
    skip = decode_seqs if cascade is None else cascade.skip  # unread without a cascade: one compiled variant
    units = 0 if cascade is None else cascade.units.shape[0] // UNIT_FIELDS
    if cascade is not None and units:
        block_m = _pow2(cascade.max_members * group)  # rows: members x the query heads of one KV head
        # K/V rows past 256 bytes (float32, or head_dim 256): 32 keys a tile keep two stages in shared memory
        # (fp32 at head_dim 256 and 64 keys would need ~280 KB; Hopper has 227 KB a block).
        big = q.element_size() * _pow2(head_dim) > 256
        _cascade_prefix_kernel[(num_kv_heads, units, prefix_splits)](
            q, k_cache, v_cache, block_tables, query_start_loc, decode_seqs, cascade.units, cascade.members,
            acc, m, l_sum, *scales, scale * _LOG2E, num_splits, prefix_splits,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_D=_pow2(head_dim),
            BLOCK_N=min(block_n, 32) if big else block_n, DOT_PRECISION=_precision(q.dtype), KV_FP8=kv_fp8, num_warps=4,
            num_stages=num_stages,
        )  # fmt: skip
    _decode_split_kernel[(num_kv_heads, num_decode, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, decode_seqs, out, acc, m, l_sum,
        *scales, skip, counters if fold else skip, scale * _LOG2E, num_splits, prefix_splits, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=_pow2(group),
        BLOCK_D=_pow2(head_dim), BLOCK_N=block_n, DOT_PRECISION=_precision(q.dtype), SLIDING=window is not None,
        KV_FP8=kv_fp8, CASCADE=cascade is not None, FOLD=fold, BLOCK_S=MAX_SPLITS, PDL=pdl, num_warps=num_warps,
        num_stages=num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    if parts == 1 or fold:
        return  # the split kernel wrote the output itself
    _decode_reduce_kernel[(num_decode, num_heads)](
        out, acc, m, l_sum, query_start_loc, decode_seqs, skip, num_splits, prefix_splits, out.stride(0),
        out.stride(1), HEAD_DIM=head_dim, BLOCK_S=MAX_SPLITS, BLOCK_D=_pow2(head_dim),  # one variant: any splits
        CASCADE=cascade is not None, num_warps=4,
    )  # fmt: skip


def _check_counters(counters: torch.Tensor, need: int, device: torch.device, cascade: Cascade | None) -> None:
    if counters.dtype != torch.int32 or counters.dim() != 1 or not counters.is_contiguous():
        raise TypeError(f"counters must be a contiguous 1-D int32 tensor; got {counters.dtype} {tuple(counters.shape)}")
    if counters.device != device:
        raise ValueError(f"counters are on {counters.device}; the queries on {device}")
    if counters.shape[0] < need:
        raise ValueError(
            f"counters hold {counters.shape[0]} entries; this launch needs decode entries x KV heads = {need}"
        )
    if cascade is not None:
        raise ValueError("counters (the folded reduce) do not combine with cascade: its merge is the reduce kernel's")


def _check_cascade(cascade: Cascade, decode_seqs: torch.Tensor, window: int | None, num_splits: int, group: int) -> int:
    """The cascade's lists against the decode work list; returns its prefix split count."""
    if window is not None:
        raise ValueError("cascade decode attention is for global layers: a sliding window reads no shared prefix")
    n = decode_seqs.shape[0]
    for name, t, size in (("skip", cascade.skip, n), ("members", cascade.members, n), ("units", cascade.units, None)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.device != decode_seqs.device:
            raise TypeError(f"cascade.{name} must be 1-D int32 on {decode_seqs.device}; got {t.dtype} {tuple(t.shape)}")
        if size is not None and t.shape[0] != size:
            raise ValueError(f"cascade.{name} holds {t.shape[0]} entries; the decode work list {size}")
    if not 1 <= cascade.max_members * group <= 256:  # the prefix kernel's rows: a tile of tl.dot in registers
        raise ValueError(
            f"cascade.max_members={cascade.max_members} x {group} query heads per KV head exceeds 256 rows"
        )
    if cascade.units.shape[0] % UNIT_FIELDS:
        raise ValueError(f"cascade.units holds {cascade.units.shape[0]} ints: {UNIT_FIELDS} per unit")
    if not 1 <= cascade.prefix_splits <= MAX_SPLITS - num_splits:
        raise ValueError(
            f"cascade.prefix_splits={cascade.prefix_splits} must be in [1, {MAX_SPLITS - num_splits}] beside "
            f"num_splits={num_splits} (at most {MAX_SPLITS} partials a sequence)"
        )
    return cascade.prefix_splits


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    tiles: torch.Tensor,  # [TILES_HEADER + 2 * capacity] int32: tile_buffer(plan_prefill_tiles(..., block_m))
    out: torch.Tensor,  # [T, H, D]: only the rows of the tiled sequences are written
    scale: float,
    block_m: int,
    num_programs: int | None = None,  # programs per head (a graph's fixed grid); default: one per tile
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int | None = None,  # a sliding window: query at position p reads keys p - window + 1..p; None: 0..p
    k_scale: torch.Tensor | None = None,  # an FP8 cache's scales: float32, one element each, on q's device
    v_scale: torch.Tensor | None = None,
) -> None:
    group, head_dim, block_size = check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    check_window(window)
    kv_fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    if tiles.dtype != torch.int32 or tiles.dim() != 1 or not tiles.is_contiguous() or tiles.device != q.device:
        raise TypeError(
            f"tiles must be a contiguous 1-D int32 buffer on {q.device}; got {tiles.dtype} {tuple(tiles.shape)}"
        )
    capacity, odd = divmod(tiles.shape[0] - TILES_HEADER, 2)
    if capacity < 0 or odd:
        raise ValueError(f"tiles holds {tiles.shape[0]} ints: expected {TILES_HEADER} + 2 per tile (tile_buffer)")
    num_programs = capacity if num_programs is None else num_programs
    if num_programs == 0:
        return
    big = q.element_size() * _pow2(head_dim) > 256  # float32 or head_dim > 128: keep K/V stages in shared memory
    block_n = block_n or (32 if big else 64)
    num_warps = num_warps or (4 if block_m <= 64 else 8)
    num_stages = num_stages or (2 if big else 3)
    _prefill_kernel[(q.shape[1], num_programs)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, tiles,
        *_scale_pointers(q, kv_fp8, k_scale, v_scale), scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_D=_pow2(head_dim),
        BLOCK_N=block_n, DOT_PRECISION=_precision(q.dtype), TILES_HEADER=TILES_HEADER, SLIDING=window is not None,
        KV_FP8=kv_fp8, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
