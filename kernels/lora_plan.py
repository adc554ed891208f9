"""Planning the batched LoRA kernels (kernels/lora.py) on the host: which rows each program takes.

A step's tokens are grouped by adapter slot into blocks of `LORA_BLOCK_M` rows (the last block of a slot
padded with -1), as fused MoE kernels group tokens by expert: each program computes one block against one
slot's weights, so a batch of many adapters runs as matrix tiles, not token by token. The launch grid holds
`max_lora_blocks(T, slots)` blocks whatever the mix (the most any T tokens over that many slots can need), so
a CUDA graph captured for T tokens replays any step of T tokens: blocks past the used ones carry slot -1 and
their programs exit at once. Plain Python over host-side per-sequence data; no Triton, no device.
"""

from __future__ import annotations

from collections.abc import Sequence

LORA_BLOCK_M = 16  # rows per program: the smallest tile a Triton dot takes


def max_lora_blocks(num_tokens: int, num_slots: int) -> int:
    """Blocks a grid holds for `num_tokens` rows over `num_slots` slots: each slot's last block may be partial,
    so sum(ceil(n_s / M)) <= ceil(T / M) + slots."""
    return -(-num_tokens // LORA_BLOCK_M) + num_slots


def plan_lora_blocks(
    seq_slots: Sequence[int], query_lens: Sequence[int], num_slots: int, num_tokens: int
) -> tuple[list[int], list[int]]:
    """(block_tokens, block_slot) for a step whose sequences, in row order, have `query_lens` rows each and
    the adapter slot `seq_slots` (-1: none); `num_tokens` rows in all, padding included.

    block_tokens: LORA_BLOCK_M row indices per used block, -1 where a slot's last block ends early.
    block_slot: `max_lora_blocks(num_tokens, num_slots)` entries: each used block's slot, then -1.
    """
    rows: list[list[int]] = [[] for _ in range(num_slots)]
    t = 0
    for slot, n in zip(seq_slots, query_lens):
        if slot >= 0:
            if n == 1:
                rows[slot].append(t)
            else:
                rows[slot].extend(range(t, t + n))
        t += n
    assert t <= num_tokens, "more sequence rows than the step's tokens"
    block_tokens: list[int] = []
    block_slot: list[int] = []
    m = LORA_BLOCK_M
    for slot, slot_rows in enumerate(rows):
        if slot_rows:
            num_blocks = -(-len(slot_rows) // m)
            block_tokens += slot_rows
            block_tokens += [-1] * (num_blocks * m - len(slot_rows))
            block_slot += [slot] * num_blocks
    block_slot += [-1] * (max_lora_blocks(num_tokens, num_slots) - len(block_slot))
    return block_tokens, block_slot


def token_slots(seq_slots: Sequence[int], query_lens: Sequence[int], num_tokens: int) -> list[int]:
    """Each row's slot (-1: none), padding rows included: the reference's `token_slots`."""
    out: list[int] = []
    for slot, n in zip(seq_slots, query_lens):
        if n == 1:
            out.append(slot)
        else:
            out += [slot] * n
    return out + [-1] * (num_tokens - len(out))
