"""Chained prefix hashes of full KV blocks.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole prefixes.
The chain starts from the root of the request's LoRA adapter (`root_hash`): the same tokens through another
adapter, or none, are other KV. xxh3-64 over a packed buffer: fast, and collisions are negligible at the
cache sizes we run. What outlives the engine (the disk tier's files, read by later engines and by others sharing
a directory) is checked against a second chain, of 128-bit BLAKE2b digests (`extend_block_digests`): a file
whose digest differs holds another prefix's KV, whatever its 64-bit hash says.
"""

from __future__ import annotations

import hashlib
from array import array

import xxhash

ROOT_HASH = 0  # the base model's chain
ROOT_DIGEST = bytes(16)  # the base model's chain of digests (an adapter's blocks are never on disk)


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


def extend_block_digests(digests: list[bytes], token_ids: list[int], block_size: int, num_blocks: int) -> None:
    """Append to `digests` until it covers the first `num_blocks` full blocks of `token_ids`: each a 128-bit
    BLAKE2b of its parent's digest and its token ids, so equal digests mean equal whole prefixes (a collision,
    chance or crafted, is out of reach; the 64-bit hashes are not)."""
    assert num_blocks * block_size <= len(token_ids), "only full blocks are hashed"
    parent = digests[-1] if digests else ROOT_DIGEST
    for i in range(len(digests), num_blocks):
        parent = hashlib.blake2b(
            parent + array("Q", token_ids[i * block_size : (i + 1) * block_size]).tobytes(), digest_size=16
        ).digest()
        digests.append(parent)
