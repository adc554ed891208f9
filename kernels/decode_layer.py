"""The persistent decode layer's launcher: a Llama/Qwen3 decoder layer for 1-16 decode rows in one launch
(decode_layer_kernels.py; `decode_layer_ref` is its specification). Checks the inputs, picks the KV split and
the compile-time constants; the tiles and the scratch come from decode_layer_plan.py. Launch shapes depend only
on the row count, so CUDA graphs replay it.
Knows nothing of models: the weights come as a `DecodeLayerWeights`.
"""

from __future__ import annotations

import math

import torch

from .decode_layer_kernels import LAST_PHASE, _decode_layer_kernel
from .decode_layer_plan import (
    BARRIER_WORDS,
    BULK_PREFETCH,
    MAX_ROWS,
    PREFETCH_MODES,
    DecodeLayerConfig,
    DecodeLayerScratch,
    check_config,
    layout_of,
    plan_config,
)
from .decode_layer_ref import DecodeLayerWeights, decode_layer_ref
from .grid_barrier import STAMPS, WORDS
from .paged_attention import _pow2
from .paged_attention_plan import MAX_SPLITS
from .quant_matmul import ACT_DTYPES, _num_sms

assert BARRIER_WORDS == WORDS, "the scratch's barrier words must be grid_barrier's"  # the plan imports no Triton

__all__ = [
    "DecodeLayerConfig",
    "DecodeLayerScratch",
    "DecodeLayerWeights",
    "decode_layer",
    "decode_layer_ref",
    "plan_config",
]


def launch_constants(
    w: DecodeLayerWeights,
    hidden: int,
    rows: int,
    config: DecodeLayerConfig,
    dtype: torch.dtype,
    block_size: int,
    residual: bool,
) -> dict[str, object]:
    """The kernel's compile-time constants (and warps) for a launch of `rows` rows."""
    block_r = 1 if rows == 1 else MAX_ROWS
    group = w.num_heads // w.num_kv_heads
    return dict(
        HIDDEN=hidden, INTER=w.down.shape[1], NUM_HEADS=w.num_heads, NUM_KV_HEADS=w.num_kv_heads,
        HEAD_DIM=w.head_dim, BLOCK_SIZE=block_size, HAS_RESIDUAL=residual, HAS_QK_NORM=w.q_norm is not None,
        BLOCK_R=block_r, BN_QKV=config.bn_qkv, BN_O=config.bn_o, BN_GU=config.bn_gate_up, BN_DOWN=config.bn_down,
        BK_QKV=config.bk_qkv, BK_O=config.bk_o, BK_GU=config.bk_gate_up, BK_DOWN=config.bk_down,
        BLOCK_G=_pow2(group),
        BLOCK_D=_pow2(w.head_dim), BLOCK_N=config.block_n, BLOCK_S=MAX_SPLITS,
        RMS_CHUNK=math.gcd(hidden, max(16, 2048 // block_r)),
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", STAGES=config.stages,
        PREFETCH=PREFETCH_MODES.index(config.prefetch), THREADS=32 * config.num_warps,
        PIECES=config.prefetch_pieces, PRELOAD=config.preload, PTX=w.qkv.device.type == "cuda",
        num_warps=config.num_warps,
    )  # fmt: skip


def _check(x: torch.Tensor, residual: torch.Tensor | None, w: DecodeLayerWeights, k_cache: torch.Tensor,
           v_cache: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
           slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           scratch: DecodeLayerScratch) -> None:  # fmt: skip
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, hidden]; got shape {tuple(x.shape)}")
    rows, hidden = x.shape
    if scratch.layout != layout_of(w):
        raise ValueError(f"the scratch was made for layers of (hidden, intermediate, heads, KV heads, head_dim, dtype, "
                         f"device) {scratch.layout}; these weights are {layout_of(w)}")  # fmt: skip
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if not 1 <= rows <= scratch.max_rows:
        raise ValueError(f"{rows} rows; the scratch holds 1 to {scratch.max_rows}")
    heads, kv_heads, dim = w.num_heads, w.num_kv_heads, w.head_dim
    shapes = {
        "x": (x, (rows, hidden)), "input_norm": (w.input_norm, (hidden,)), "post_norm": (w.post_norm, (hidden,)),
        "qkv": (w.qkv, ((heads + 2 * kv_heads) * dim, hidden)), "o": (w.o, (hidden, heads * dim)),
        "gate_up": (w.gate_up, (2 * w.down.shape[1], hidden)), "down": (w.down, (hidden, w.down.shape[1])),
        "k_cache": (k_cache, (k_cache.shape[0], k_cache.shape[1], kv_heads, dim)),
    }  # fmt: skip
    if residual is not None:
        shapes["residual"] = (residual, (rows, hidden))
    if w.q_norm is not None and w.k_norm is not None:
        shapes |= {"q_norm": (w.q_norm, (dim,)), "k_norm": (w.k_norm, (dim,))}
    elif w.q_norm is not None or w.k_norm is not None:
        raise ValueError("q_norm and k_norm come together or not at all")
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape or t.dtype != x.dtype or not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"{name} must be a contiguous {shape} {x.dtype} on {x.device}; got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")  # fmt: skip
    if v_cache.shape != k_cache.shape or v_cache.dtype != x.dtype or v_cache.stride() != k_cache.stride():
        raise ValueError("v_cache must match k_cache's shape, strides and the activations' dtype (no FP8 cache)")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"the cache's block_size {block_size} must be a power of two")
    if heads % kv_heads or dim % 2:
        raise ValueError(f"num_heads {heads} must be a multiple of num_kv_heads {kv_heads}, head_dim {dim} even")
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if (table.dim() != 2 or table.shape[1] != dim // 2 or table.stride(1) != 1 or table.device != x.device
                or table.dtype not in (torch.float32, x.dtype)):  # fmt: skip
            raise ValueError(f"{name} must be [max_positions, head_dim / 2 = {dim // 2}] with contiguous rows, "
                             f"float32 or {x.dtype}, on {x.device}; got {tuple(table.shape)} "
                             f"{table.dtype}")  # fmt: skip
    if sin_cache.shape != cos_cache.shape or sin_cache.dtype != cos_cache.dtype:
        raise ValueError("sin_cache must match cos_cache's shape and dtype")
    for name, t, dtype in (("positions", positions, torch.int64), ("slot_mapping", slot_mapping, torch.int64),
                           ("seq_lens", seq_lens, torch.int32)):  # fmt: skip
        if t.shape != (rows,) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{rows}] {dtype}; got {tuple(t.shape)} {t.dtype}")
    if (block_tables.dim() != 2 or block_tables.shape[0] < rows or block_tables.dtype != torch.int32
            or block_tables.stride(1) != 1):  # fmt: skip
        raise ValueError(f"block_tables must be int32 [>= {rows}, max_blocks] with contiguous rows; got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}, strides "
                         f"{block_tables.stride()}")  # fmt: skip


def decode_layer(
    x: torch.Tensor,  # [R, hidden]
    residual: torch.Tensor | None,  # [R, hidden]; None: layer 0
    w: DecodeLayerWeights,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], x's dtype
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # [R] int64
    cos_cache: torch.Tensor,  # [max_positions, D / 2] (float32 or x's dtype), sin_cache alike
    sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [R] int64; -1: no store (a graph's padding; a row of seq_len 0 must have it)
    block_tables: torch.Tensor,  # [>= R, max_blocks] int32, row r the table of row r
    seq_lens: torch.Tensor,  # [R] int32 with the new token; 0: a padding row
    scale: float,
    scratch: DecodeLayerScratch,
    *,
    programs: int | None = None,  # None: one per SM (at most: the barrier needs every program resident)
    num_splits: int | None = None,  # KV splits a row and KV head; None: enough to give every program one
    config: DecodeLayerConfig | None = None,
    phases: bool = False,  # one launch a phase, no barrier (the interpreter's tests)
    clock: torch.Tensor | None = None,  # int64 [programs, STAMPS]: each program's GPU clock (ns) at its start,
    # each barrier's arrival and return, its end (the bench's phase breakdown; CUDA only)
    next_qkv: torch.Tensor | None = None,  # the next layer's qkv weight, asked of L2 during this launch's MLP
    # (config.prefetch "ahead" only: the launch after this one then reads it from L2)
) -> tuple[torch.Tensor, torch.Tensor]:  # (the MLP's output, the residual stream before it), each [R, hidden]
    """decode_layer_ref's results in one launch; the caches get this step's keys and values.

    Launches that share a scratch must run one after another (one stream): they share its barrier. The one
    launch waits at its barriers for all its programs, which must all be resident at once: at most one per SM,
    and no other kernel may hold SMs indefinitely meanwhile (no persistent kernel on another stream, no MPS
    limit below the SM count). Values in device memory are not range-checked (a host sync would stall the
    step): positions within the rotary tables, each row's seq_len within its block table's width, slots
    within the cache; a padding row's position too (its rotary values are read, then unused)."""
    _check(x, residual, w, k_cache, v_cache, positions, cos_cache, sin_cache, slot_mapping, block_tables, seq_lens,
           scratch)  # fmt: skip
    rows, hidden = x.shape
    sms = _num_sms(x.device)
    programs = sms if programs is None else programs
    if not 1 <= programs <= (sms if not phases else 4 * sms):
        raise ValueError(f"programs={programs} must be in [1, {sms}]: every program waits for the others")
    if num_splits is None:
        num_splits = max(1, min(MAX_SPLITS, programs // (rows * w.num_kv_heads)))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} must be in [1, {MAX_SPLITS}]")
    if config is None:
        config = plan_config(w, rows, programs)
    else:
        check_config(config, w, rows)
    if config.prefetch != "off" and x.device.type != "cuda":
        raise ValueError(f"config.prefetch={config.prefetch!r} asks L2 through PTX: CUDA only")
    if config.prefetch in BULK_PREFETCH and torch.cuda.get_device_capability(x.device) < (9, 0):
        raise ValueError(f"config.prefetch={config.prefetch!r} uses Hopper's copy engine (sm_90 or newer); this "
                         f"card is sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}")  # fmt: skip
    if clock is not None and (clock.shape != (programs, STAMPS) or clock.dtype != torch.int64 or not clock.is_cuda
                              or not clock.is_contiguous() or phases):  # fmt: skip
        raise ValueError(f"clock must be a contiguous CUDA int64 [programs={programs}, {STAMPS}], one launch")
    if next_qkv is not None and (config.prefetch != "ahead" or next_qkv.shape != w.qkv.shape
                                 or next_qkv.dtype != w.qkv.dtype or next_qkv.device != w.qkv.device
                                 or not next_qkv.is_contiguous()):  # fmt: skip
        raise ValueError(f"next_qkv must be a contiguous {tuple(w.qkv.shape)} {w.qkv.dtype} on {w.qkv.device} "
                         f"(this layer's qkv's layout) with config.prefetch 'ahead'; got {tuple(next_qkv.shape)} "
                         f"{next_qkv.dtype} on {next_qkv.device}, prefetch {config.prefetch!r}")  # fmt: skip
    if config.prefetch in BULK_PREFETCH:
        for name, t in (("qkv", w.qkv), ("o", w.o), ("gate_up", w.gate_up), ("down", w.down), ("next_qkv", next_qkv)):
            if t is not None and t.data_ptr() % 16:
                raise ValueError(f"{name} starts off a 16-byte boundary: config.prefetch={config.prefetch!r} asks "
                                 "the copy engine, which takes 16-byte-aligned ranges")  # fmt: skip
    out, h1 = torch.empty_like(x), torch.empty_like(x)
    s = scratch
    q_norm = w.input_norm if w.q_norm is None else w.q_norm  # never read without norms
    k_norm = w.input_norm if w.k_norm is None else w.k_norm
    args = (
        x, x if residual is None else residual, w.input_norm, w.qkv, q_norm, k_norm, w.o, w.post_norm, w.gate_up,
        w.down, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
        s.qkv, s.attn, s.act, s.acc, s.m, s.l_sum, s.tickets, s.barrier, out, h1,
        w.qkv if next_qkv is None else next_qkv, x if clock is None else clock,
        rows, num_splits, w.eps, scale * math.log2(math.e), cos_cache.stride(0), sin_cache.stride(0),
        block_tables.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
    )  # fmt: skip
    consts = launch_constants(w, hidden, rows, config, x.dtype, k_cache.shape[1], residual is not None)
    for phase in range(1, LAST_PHASE + 1) if phases else (0,):
        _decode_layer_kernel[(programs,)](*args, NEXT=next_qkv is not None, PHASE=phase, TIMING=clock is not None,
                                          **consts)  # fmt: skip
    return out, h1
