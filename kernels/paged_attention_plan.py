"""Planning for the paged attention kernels (kernels/paged_attention.py), on the host: how many KV splits a
decode sequence gets, which query tiles the prefill kernel walks and in what order, and the tile buffer's
layout and bound. Plain Python over host-side lengths; no Triton, no device.
"""

from __future__ import annotations

import torch

# A split of a decode sequence covers at least this many keys: shorter splits cost more in the reduction
# than they win in parallelism.
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 32  # a power of two: the reduction kernel's fixed width
# int32 slots before the prefill tiles in a tile buffer: [count, 0, 0, 0] then (sequence, first row) pairs.
# Four keeps the tiles 16-byte aligned, as Triton specialises pointer arguments on that alignment.
TILES_HEADER = 4


def choose_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per decode sequence: enough programs to fill the GPU twice, but never under
    MIN_TOKENS_PER_SPLIT keys per split of the longest sequence (it sets how much each split walks)."""
    by_length = -(-max_seq_len // MIN_TOKENS_PER_SPLIT)
    to_fill = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(by_length, to_fill, MAX_SPLITS))


def plan_prefill_tiles(query_lens: list[int], seq_lens: list[int], block_m: int) -> list[tuple[int, int]]:
    """(sequence index, first query row in it) of every BLOCK_M query tile of the multi-token sequences,
    heaviest (most keys) first so the longest programs do not start last."""
    tiles = [
        (i, start)
        for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens))
        if q_len > 1
        for start in range(0, q_len, block_m)
    ]
    keys_seen = {(i, s): min(seq_lens[i], seq_lens[i] - query_lens[i] + s + block_m) for i, s in tiles}
    return sorted(tiles, key=lambda t: -keys_seen[t])


def tile_buffer(tiles: list[tuple[int, int]], capacity: int | None = None) -> list[int]:
    """The prefill kernel's tile argument, as host ints: [len(tiles), 0, 0, 0] then the flattened pairs,
    padded with zeros to `capacity` tiles (a graph's fixed buffer) when given."""
    capacity = len(tiles) if capacity is None else capacity
    if len(tiles) > capacity:
        raise ValueError(f"{len(tiles)} prefill tiles do not fit a buffer planned for {capacity}")
    flat = [v for tile in tiles for v in tile]
    return [len(tiles)] + [0] * (TILES_HEADER - 1) + flat + [0] * (2 * (capacity - len(tiles)))


def max_prefill_tiles(num_tokens: int, max_seqs: int, block_m: int) -> int:
    """The most tiles a step of `num_tokens` query rows in at most `max_seqs` sequences can need: a
    multi-token sequence of q rows takes ceil(q / block_m) <= q // block_m + 1 tiles, the q // block_m sum to
    at most num_tokens // block_m, and there are at most min(max_seqs, num_tokens // 2) such sequences."""
    return num_tokens // block_m + min(max_seqs, num_tokens // 2)


def prefill_block_m(dtype: torch.dtype, device: torch.device) -> int:
    """Query rows per prefill program; the backend plans tiles with it (small under the CPU interpreter)."""
    if device.type != "cuda":
        return 16
    return 64 if dtype == torch.float32 else 128
