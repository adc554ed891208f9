"""The persistent decode layer's host-side plan (kernels/decode_layer.py launches it): each projection's tiles
(`plan_config`) and the scratch a launch writes between its phases (`DecodeLayerScratch`: allocated once,
shared by a model's layers, which run one after another). Imports no Triton, so a model can hold its scratch
without compiling anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode_layer_ref import DecodeLayerWeights
from .paged_attention_plan import MAX_SPLITS

BARRIER_WORDS = 5  # grid_barrier.WORDS (not imported: that module imports Triton): the round, 4 arrival counts
MAX_ROWS = 16  # rows share each weight tile through one 16-row tensor-core dot
# How a launch asks L2 for its weights before its phases read them (decode_layer_kernels.py's PREFETCH says how
# each does it): not at all; the whole layer at the start, line by line; each program's own tiles at the start
# through the copy engine (Hopper); its qkv tiles at the start, the rest and its attention's keys once they are
# read (Hopper).
PREFETCH_MODES = ("off", "lines", "bulk", "ahead")
BULK_PREFETCH = ("bulk", "ahead")  # cp.async.bulk: sm_90 or newer


@dataclass(frozen=True)
class DecodeLayerConfig:
    """Each projection's tile: output columns (bn_*) and the K step (bk_*); attention's keys per tile; warps a
    program; weight steps in flight (software pipelining)."""

    bn_qkv: int
    bk_qkv: int
    bn_o: int
    bk_o: int
    bn_gate_up: int
    bk_gate_up: int
    bn_down: int
    bk_down: int
    block_n: int = 32
    num_warps: int = 4
    stages: int = 1
    prefetch: str = "off"  # one of PREFETCH_MODES (CUDA only)
    prefetch_pieces: int = 1  # bulk, ahead: copy-engine requests a tile's range is split into
    preload: bool = True  # weights double-buffered in registers, a phase's first step asked during its barrier


def plan_config(
    w: DecodeLayerWeights,
    rows: int,
    programs: int,
    step_bytes: int = 32 << 10,
    num_warps: int = 4,
    stages: int = 1,
    prefetch: str = "off",
    preload: bool = True,
) -> DecodeLayerConfig:
    """Tiles that spread each projection over the programs with the least work on the busiest one (ties: the
    larger tile, fewer loop trips), and K steps of about `step_bytes` of weights (all of them in flight at
    once: a program's bandwidth is what it has in flight over the memory's latency), a power of two dividing K.
    `preload` (measured faster: 39.5 against 41.3 us a Qwen3-0.6B layer on an H100, bench/RESULTS.md 2026-12-08)
    holds two steps in registers at once (202 registers a thread at one row, no spill, sm_90a); 16 KiB steps
    measured slower (47.6 us: half the bytes in flight)."""
    if prefetch not in PREFETCH_MODES:
        raise ValueError(f"prefetch={prefetch!r} is not one of {PREFETCH_MODES}")
    hidden, inter = w.input_norm.shape[0], w.down.shape[1]
    smallest = 8 if rows == 1 else 16  # the dot's tiles are 16 wide at least
    itemsize = w.qkv.element_size()

    def tile(n: int, k: int, pair: int = 1) -> tuple[int, int]:
        fits = [bn for bn in (128, 64, 32, 16, 8) if bn >= smallest and n % bn == 0]
        if not fits:
            raise ValueError(f"a projection of {n} outputs (K={k}) is not a multiple of {smallest} at {rows} rows")
        bn = min(fits, key=lambda bn: (-(-(n // bn) // programs) * bn, -bn))
        cap = max(16, step_bytes // (itemsize * bn * pair))
        if rows > 1:
            cap = min(cap, 256)  # the dot holds the rows' [16, BK] activations in registers too
        bk = 1 << min(cap.bit_length() - 1, (k & -k).bit_length() - 1)  # the largest power of two dividing k
        if bk < 16:
            raise ValueError(f"a projection of K={k} ({n} outputs) needs a power-of-two factor of 16 or more")
        return bn, bk

    (bn_qkv, bk_qkv), (bn_o, bk_o) = tile(w.qkv.shape[0], hidden), tile(hidden, w.num_heads * w.head_dim)
    (bn_gu, bk_gu), (bn_down, bk_down) = tile(inter, hidden, 2), tile(hidden, inter)
    return DecodeLayerConfig(bn_qkv, bk_qkv, bn_o, bk_o, bn_gu, bk_gu, bn_down, bk_down, num_warps=num_warps,
                             stages=stages, prefetch=prefetch, preload=preload)  # fmt: skip


def layout_of(w: DecodeLayerWeights) -> tuple[object, ...]:
    """What a scratch's sizes depend on: hidden, intermediate, heads, KV heads, head_dim, dtype, device."""
    return (w.input_norm.shape[0], w.down.shape[1], w.num_heads, w.num_kv_heads, w.head_dim, w.qkv.dtype,
            w.qkv.device)  # fmt: skip


def check_config(config: DecodeLayerConfig, w: DecodeLayerWeights, rows: int) -> None:
    """Raises ValueError naming the projection whose tile does not fit: output columns dividing N (16 or more
    with several rows: the dot's), a power-of-two K step of 16 or more dividing K."""
    hidden, inter = w.input_norm.shape[0], w.down.shape[1]
    tiles = {
        "qkv": (config.bn_qkv, config.bk_qkv, w.qkv.shape[0], hidden),
        "o": (config.bn_o, config.bk_o, hidden, w.num_heads * w.head_dim),
        "gate_up": (config.bn_gate_up, config.bk_gate_up, inter, hidden),
        "down": (config.bn_down, config.bk_down, hidden, inter),
    }
    if config.prefetch not in PREFETCH_MODES:
        raise ValueError(f"config's prefetch {config.prefetch!r} is not one of {PREFETCH_MODES}")
    if not 1 <= config.prefetch_pieces <= 32 * config.num_warps:
        raise ValueError(f"config's prefetch_pieces={config.prefetch_pieces} must be in [1, {32 * config.num_warps}] "
                         f"(one request a thread of its {config.num_warps} warps)")  # fmt: skip
    for name, (bn, bk, n, k) in tiles.items():
        pow2 = bn & (bn - 1) == 0 and bk & (bk - 1) == 0
        if not pow2 or n % bn or k % bk or bk < 16 or bn < (16 if rows > 1 else 1):
            raise ValueError(
                f"config's {name} tile ({bn} outputs, K step {bk}) does not fit its {n} outputs of K={k} "
                f"at {rows} rows (powers of two dividing them; K step >= 16; >= 16 outputs at 2+ rows)"
            )


class DecodeLayerScratch:
    """What one launch writes between its phases, for up to `max_rows` rows, plus the grid barrier and the
    attention merge's tickets (zero between launches: each launch leaves them so)."""

    def __init__(self, w: DecodeLayerWeights, max_rows: int, device: torch.device) -> None:
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows={max_rows} must be in [1, {MAX_ROWS}]")
        dtype, heads, dim = w.qkv.dtype, w.num_heads, w.head_dim
        self.max_rows = max_rows
        self.layout = layout_of(w)  # the layers it serves: their launches index these buffers by those sizes
        self.qkv = torch.empty(max_rows, w.qkv.shape[0], dtype=dtype, device=device)
        self.attn = torch.empty(max_rows, heads * dim, dtype=dtype, device=device)
        self.act = torch.empty(max_rows, w.down.shape[1], dtype=dtype, device=device)
        self.acc = torch.empty(max_rows, heads, MAX_SPLITS, dim, dtype=torch.float32, device=device)
        self.m = torch.empty(max_rows, heads, MAX_SPLITS, dtype=torch.float32, device=device)
        self.l_sum = torch.empty_like(self.m)
        self.tickets = torch.zeros(max_rows, w.num_kv_heads, dtype=torch.int32, device=device)
        self.barrier = torch.zeros(BARRIER_WORDS, dtype=torch.int32, device=device)
