"""Planning the batched LoRA kernels (kernels/lora.py) on the host: which rows each program takes.

A step's tokens are grouped by adapter slot into blocks of `LORA_BLOCK_M` rows (the last block of a slot
padded with -1), as fused MoE kernels group tokens by expert: each program computes one block against one
slot's weights, so a batch of many adapters runs as matrix tiles, not token by token. The launch grid holds
`max_lora_blocks(T, slots)` blocks whatever the mix (the most any T tokens over that many slots can need), so
a CUDA graph captured for T tokens replays any step of T tokens: blocks past the used ones carry slot -1 and
their programs exit at once. `plan_lora_launch` picks, from shapes alone (so a captured graph's choice holds for
every replay), between one fused launch and a split-K shrink then an expand. Host-side plain Python and
numpy over per-sequence data; no Triton, no device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

LORA_BLOCK_M = 16  # rows per program: the smallest tile a Triton dot takes


def max_lora_blocks(num_tokens: int, num_slots: int) -> int:
    """Blocks a grid holds for `num_tokens` rows over `num_slots` slots: each slot's last block may be partial,
    so sum(ceil(n_s / M)) <= ceil(T / M) + slots."""
    return -(-num_tokens // LORA_BLOCK_M) + num_slots


def plan_lora_blocks(
    seq_slots: Sequence[int] | np.ndarray, query_lens: Sequence[int], num_slots: int, num_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """(block_tokens, block_slot), int32, for a step whose sequences, in row order, have `query_lens` rows each
    (entries past the sequences' are ignored) and the adapter slot `seq_slots` (-1: none); `num_tokens` rows
    in all, padding included.

    block_tokens: LORA_BLOCK_M row indices per used block (a slot's rows in row order, slots in order), -1
    where a slot's last block ends early.
    block_slot: `max_lora_blocks(num_tokens, num_slots)` entries: each used block's slot, then -1.

    In numpy over the sequences (a prompt's rows move as one range): a few array calls and a loop over the
    slots, whatever the batch; no Python per row or sequence.
    """
    m = LORA_BLOCK_M
    slots = np.asarray(seq_slots, dtype=np.int64)  # [S]
    lens = np.asarray(query_lens[: len(slots)], dtype=np.int64)  # [S]
    ends = np.cumsum(lens)
    assert not len(ends) or ends[-1] <= num_tokens, "more sequence rows than the step's tokens"
    order = np.argsort(slots, kind="stable")  # sequences by slot, in row order within one
    by_slot = slots[order]
    first = int(np.searchsorted(by_slot, 0))  # sequences without an adapter (-1) sort first: drop them
    order, by_slot = order[first:], by_slot[first:]
    seq_rows, seq_start = lens[order], (ends - lens)[order]
    counts = np.bincount(by_slot, weights=seq_rows, minlength=num_slots).astype(np.int64)  # [slots] rows of each
    blocks = -(-counts // m)
    used = int(blocks.sum())
    block_slot = np.full(max_lora_blocks(num_tokens, num_slots), -1, dtype=np.int32)
    block_slot[:used] = np.repeat(np.arange(num_slots, dtype=np.int32), blocks)
    total = int(counts.sum())
    if total == len(seq_rows):  # one row a sequence (decodes)
        rows = seq_start
    else:  # each sequence's rows, sequence after sequence, in the sorted order
        rows = np.arange(total) + np.repeat(seq_start - (np.cumsum(seq_rows) - seq_rows), seq_rows)
    # A slot's rows are a run of the sorted rows; they go to the front of its blocks, one slice a slot.
    block_tokens = np.full(used * m, -1, dtype=np.int32)
    dest, src = ((np.cumsum(blocks) - blocks) * m).tolist(), (np.cumsum(counts) - counts).tolist()
    for slot, n in enumerate(counts.tolist()):
        if n:
            block_tokens[dest[slot] : dest[slot] + n] = rows[src[slot] : src[slot] + n]
    return block_tokens, block_slot


def token_slots(seq_slots: Sequence[int] | np.ndarray, query_lens: Sequence[int], num_tokens: int) -> np.ndarray:
    """Each row's slot (-1: none), int32, padding rows included: the reference's `token_slots`."""
    slots = np.asarray(seq_slots, dtype=np.int32)
    out = np.full(num_tokens, -1, dtype=np.int32)
    rows = np.repeat(slots, np.asarray(query_lens[: len(slots)], dtype=np.int64))
    out[: len(rows)] = rows
    return out


# Launch shapes, from bench/kernels/bench_lora.py on the H200 (run 61, bench/RESULTS.md): a launch costs ~2 us in
# a graph; wide K tiles (all of a tile's loads in flight at once), few per program. At 1-256 rows o_proj's K of
# 2,048 (two K tiles) took 8.0-8.5 us fused against 6.0-6.5 split; at 8,192 rows every layer was faster split
# (no re-shrinks: qkv 82 against 113 us, down 40 against 51), at 2,048 three of four faster fused.
FUSED_MAX_K_STEPS = 1  # K tiles a fused program walks at most while the grid is small: past it, split K
SPLIT_MIN_ROWS = 4096  # from this many rows the fused path's re-shrinks outweigh the second launch
FUSED_EXTRA_BYTES = 8 << 20  # L2 re-reads fusing may add (each column program re-shrinks its block): ~2 us of L2
SHRINK_PROGRAMS = 256  # below this many (row block, shard) programs the grid is small (132 SMs)
MAX_SPLITS = 8  # the expand sums at most this many partial sums, unrolled
FUSED_WARPS, SPLIT_WARPS = 8, 4  # the fused kernel's and the shrink's and expand's
# A K tile's loads (x's [16, block_k] and A's [block_k, R]) all in flight at once: 256 bytes a thread.
LOAD_BYTES_PER_THREAD = 256

LoRAPath = Literal["fused", "split"]
LORA_PATHS: tuple[LoRAPath, ...] = ("fused", "split")


@dataclass(frozen=True)
class LoRALaunch:
    """How `lora_add` runs for one shape. "fused": one launch; each program (a row block, `tiles` column
    tiles of `block_n` in one shard) shrinks its block over all of K, then expands into its tiles in turn.
    "split": a shrink whose programs each take `k_chunk` of K (`splits` partial sums, no atomics, nothing to
    zero), then an expand that sums them; two launches, no re-reads."""

    path: LoRAPath
    block_n: int  # output columns per tile (a power of two >= 16)
    block_k: int  # K per step of the shrink's loop (a power of two >= 16)
    splits: int  # the shrink's K splits (1 on the fused path, at most MAX_SPLITS)
    k_chunk: int  # K columns per split, a multiple of block_k; splits * k_chunk >= K
    tiles: int = 1  # column tiles a fused program takes (1 on the split path)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LoRALaunch.{name} must be a power of two >= 16; got {value}")
        if not 1 <= self.splits <= MAX_SPLITS or self.k_chunk < self.block_k or self.k_chunk % self.block_k:
            raise ValueError(
                f"LoRALaunch: splits must be 1..{MAX_SPLITS} and k_chunk a multiple of block_k {self.block_k}; "
                f"got splits={self.splits}, k_chunk={self.k_chunk}"
            )
        if self.path == "fused" and self.splits != 1:
            raise ValueError(f"LoRALaunch: the fused path takes K whole (splits=1); got splits={self.splits}")
        if self.tiles < 1 or (self.path == "split" and self.tiles != 1):
            raise ValueError(f"LoRALaunch: tiles must be >= 1 (1 on the split path); got tiles={self.tiles}")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _floor_pow2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def plan_lora_launch(
    num_tokens: int,
    num_slots: int,
    k: int,
    shard_sizes: Sequence[int],
    rank: int,
    itemsize: int,
    path: LoRAPath | None = None,
) -> LoRALaunch:
    """The launch for `num_tokens` rows over `num_slots` slots, input width `k`, output shards `shard_sizes`,
    padded rank `rank`, weights of `itemsize` bytes; `path` forces a path (benchmarks, tests)."""
    blocks = max_lora_blocks(num_tokens, num_slots)
    used = min(blocks, num_tokens)  # the most blocks a step can use: each holds a row
    widest = max(shard_sizes)
    tile_bytes = (LORA_BLOCK_M + rank) * itemsize  # x's and A's bytes per K column
    # Tiles shrink as the rank grows: A's [block_k, R] and B's [R, block_n] stay within registers.
    fused_k = max(16, min(_floor_pow2(LOAD_BYTES_PER_THREAD * 32 * FUSED_WARPS // tile_bytes), _pow2(k)))
    fused_n = max(16, min(512, 8192 // rank, _pow2(widest)))
    # The small grid of a decode step wants a program per column tile; a larger one fills the device with
    # fewer, each taking more tiles of its shard: the fewest tiles a program whose re-shrinks (every column
    # program past a shard's first reads its block's x rows and A's rows again) stay within FUSED_EXTRA_BYTES.
    widest_tiles = -(-widest // fused_n)
    tiles = 1
    while tiles < widest_tiles:
        programs = sum(-(-n // (fused_n * tiles)) for n in shard_sizes)
        if used * (programs - len(shard_sizes)) * tile_bytes * k <= FUSED_EXTRA_BYTES:
            break
        tiles = min(2 * tiles, widest_tiles)
    few = blocks * len(shard_sizes) < SHRINK_PROGRAMS  # the row blocks alone do not fill the device
    if path is None:
        # A long K walked by a few programs in turn outlasts a launch: split it. Once the row blocks fill the
        # device, splitting would only add partial sums for the expand to read, until the rows are so many that
        # the fused programs' re-shrinks cost more than the expand's launch.
        short_k = -(-k // fused_k) <= FUSED_MAX_K_STEPS
        path = "fused" if (short_k or not few) and num_tokens < SPLIT_MIN_ROWS else "split"
    if path == "fused":
        return LoRALaunch("fused", fused_n, fused_k, 1, -(-k // fused_k) * fused_k, tiles)
    block_k = max(16, min(_floor_pow2(LOAD_BYTES_PER_THREAD * 32 * SPLIT_WARPS // tile_bytes), _pow2(k)))
    tiles_k = -(-k // block_k)
    splits = min(MAX_SPLITS, tiles_k) if few else 1  # one K tile a program while the grid is small
    k_chunk = -(-tiles_k // splits) * block_k
    return LoRALaunch("split", max(16, min(128, 8192 // rank, _pow2(widest))), block_k, -(-k // k_chunk), k_chunk)
