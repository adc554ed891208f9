"""Chained prefix hashes of full KV blocks.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole prefixes.
The chain starts from the root of the request's LoRA adapter (`root_hash`): the same tokens through another
adapter, or none, are other KV. xxh3-64 over a packed buffer: fast, and collisions are negligible at the
cache sizes we run.
"""

from __future__ import annotations

from array import array

import xxhash

ROOT_HASH = 0  # the base model's chain


def root_hash(lora_id: int) -> int:
    """Where the chain of a request through LoRA adapter `lora_id` starts (ids are never reused)."""
    return ROOT_HASH if lora_id == 0 else xxhash.xxh3_64_intdigest(b"lora" + lora_id.to_bytes(8, "little"))


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    # Unsigned: xxh3 digests use all 64 bits (a signed array overflowed on about half of all parents).
    # Token ids are validated non-negative, so they pack as unsigned too.
    buf = array("Q", [parent_hash])
    buf.extend(token_ids)
    return xxhash.xxh3_64_intdigest(buf.tobytes())


def extend_block_hashes(
    hashes: list[int], token_ids: list[int], block_size: int, num_blocks: int, root: int = ROOT_HASH
) -> None:
    """Append hashes to `hashes` until it covers the first `num_blocks` full blocks of `token_ids`; the chain
    starts from `root` (`root_hash` of the request's adapter)."""
    assert num_blocks * block_size <= len(token_ids), "only full blocks are hashed"
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
