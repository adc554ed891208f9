"""Block-accounting invariants shared by the core tests: checked after every step of every scenario."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request


def check_block_invariants(bm: BlockManager, live: Iterable[Request], held: Iterable[int] = ()) -> None:
    """No block both free and held; ref counts equal holders; the hash index is truthful; nothing leaks.
    `held`: references taken by others than requests (`Scheduler.held_block_ids`)."""
    holders: Counter[int] = Counter()
    for request in live:
        blocks = bm.held_block_ids(request)
        assert len(set(blocks)) == len(blocks), f"{request.request_id} holds a block twice"
        holders.update(blocks)
    holders.update(held)
    free = set(bm.free_block_ids())
    cached = bm.cached_blocks()
    assert len(free) == bm.num_free_blocks
    assert not free & set(holders), f"blocks both free and held: {sorted(free & set(holders))}"
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count}, held by {holders[block.block_id]}"
        )
    for block_hash, block in cached.items():
        assert block.block_hash == block_hash, f"index maps a hash to block {block.block_id} holding another"
    hashed = [b for b in bm.blocks if b.block_hash is not None]
    assert len(hashed) == len(cached), "a hashed block is missing from the index"
    assert bm.num_free_blocks + len(holders) == bm.num_blocks, "a block is neither free nor held"
