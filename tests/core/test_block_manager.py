"""BlockManager: reference counts, LRU eviction and the prefix-cache index."""

from __future__ import annotations

import random

import pytest

from asyncllm.core.block_hash import ROOT_HASH, extend_block_hashes, hash_block
from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request
from asyncllm.sampling_params import SamplingParams
from tests.core.invariants import check_block_invariants

BS = 4


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(), arrival_time=0.0, max_tokens=8)


def _admit(bm: BlockManager, request: Request) -> int:
    """Admit like the scheduler does (whole prompt, one chunk); returns the cached token count."""
    cached = bm.find_cached_prefix(request)
    num_cached = len(cached) * bm.block_size
    assert bm.allocate(request, request.num_tokens - num_cached, cached)
    bm.record_prefix_query(request.num_tokens, num_cached)
    request.num_computed_tokens = request.num_tokens
    bm.commit_pending()  # the step that computed its KV has run
    return num_cached


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS, True)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0, True)


def test_allocate_and_free_round_trip() -> None:
    rng = random.Random(1)
    bm = BlockManager(8, BS, True)
    a = _request("a", _prompt(rng, 10))
    assert _admit(bm, a) == 0
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 5
    check_block_invariants(bm, [a])
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 8
    bm.free(a)  # a second free of the same request has nothing left to release
    check_block_invariants(bm, [])


def test_allocate_failure_changes_nothing() -> None:
    rng = random.Random(2)
    bm = BlockManager(4, BS, True)
    a = _request("a", _prompt(rng, 12))
    _admit(bm, a)
    b = _request("b", _prompt(rng, 8))
    assert not bm.allocate(b, 8)
    assert b.block_ids == [] and bm.num_free_blocks == 1
    check_block_invariants(bm, [a])


def test_hit_on_repeated_prefix_shares_blocks() -> None:
    rng = random.Random(3)
    bm = BlockManager(16, BS, True)
    shared = _prompt(rng, 8)
    a = _request("a", [*shared, *_prompt(rng, 3)])
    b = _request("b", [*shared, *_prompt(rng, 5)])
    _admit(bm, a)
    assert _admit(bm, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / (11 + 13))
    check_block_invariants(bm, [a, b])
    bm.free(a)  # the shared head stays held by b
    assert bm.blocks[b.block_ids[0]].ref_count == 1 and b.block_ids[0] not in bm.free_block_ids()
    check_block_invariants(bm, [b])


def test_full_prompt_hit_recomputes_last_token() -> None:
    """A prompt of whole blocks seen before hits all but its last block: the last token must be computed."""
    rng = random.Random(4)
    bm = BlockManager(16, BS, True)
    prompt = _prompt(rng, 3 * BS)
    a = _request("a", prompt)
    _admit(bm, a)
    bm.free(a)
    b = _request("b", list(prompt))
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2  # (12 - 1) // 4
    assert _admit(bm, b) == 2 * BS
    check_block_invariants(bm, [b])


def test_cached_free_blocks_count_as_free() -> None:
    rng = random.Random(5)
    bm = BlockManager(6, BS, True)
    a = _request("a", _prompt(rng, 17))
    _admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 6 and len(bm.cached_blocks()) == 4  # four full blocks stay findable
    b = _request("b", _prompt(rng, 24))  # needs all six: evicts the cached ones
    assert bm.allocate(b, 24)
    assert bm.num_free_blocks == 0
    assert not any(h in bm.cached_blocks() for h in a.block_hashes)  # evicted blocks left the index
    check_block_invariants(bm, [b])


def test_reused_block_leaves_the_index() -> None:
    """Regression (stale prefix hash): a cached block taken for other content must stop serving its old
    prefix, or a later request with that prefix reads another request's KV."""
    rng = random.Random(6)
    bm = BlockManager(3, BS, True)
    old = _prompt(rng, 9)
    a = _request("a", old)
    _admit(bm, a)
    bm.free(a)
    other = _request("other", _prompt(rng, 12))
    assert bm.allocate(other, 12)  # takes all three blocks, the two cached ones included
    assert not any(h in bm.cached_blocks() for h in a.block_hashes)
    assert bm.find_cached_prefix(_request("again", list(old))) == []
    bm.free(other)
    check_block_invariants(bm, [])
    assert bm.find_cached_prefix(_request("again2", list(old))) == []


def test_lru_evicts_tail_before_head() -> None:
    rng = random.Random(7)
    bm = BlockManager(3, BS, True)
    prompt = _prompt(rng, 3 * BS)
    a = _request("a", prompt)
    _admit(bm, a)
    head, middle, tail = a.block_ids
    bm.free(a)
    c = _request("c", _prompt(rng, 2))
    assert bm.allocate(c, 2)
    assert c.block_ids == [tail]  # the tail was freed first, so it is evicted first
    b = _request("b", [*prompt[: 2 * BS], *_prompt(rng, 2)])
    assert [blk.block_id for blk in bm.find_cached_prefix(b)] == [head, middle]
    check_block_invariants(bm, [c])


def test_blocks_holding_no_prefix_are_taken_again_first() -> None:
    """A freed block no prefix can reuse (prefix caching off, or a partial last block) is the next one taken,
    before cached blocks and before blocks never written: a CPU cache's pages are committed as blocks are first
    written, so reusing them keeps resident memory at what requests hold. Cached blocks keep their LRU order."""
    rng = random.Random(71)
    bm = BlockManager(16, BS, False)
    a = _request("a", _prompt(rng, 10))
    _admit(bm, a)
    held = sorted(a.block_ids)
    bm.free(a)
    b = _request("b", _prompt(rng, 10))
    _admit(bm, b)
    assert sorted(b.block_ids) == held
    check_block_invariants(bm, [b])

    bm = BlockManager(16, BS, True)
    prompt = _prompt(rng, 10)  # two full blocks (cached) and a partial one
    a = _request("a", prompt)
    _admit(bm, a)
    *full, partial = a.block_ids
    bm.free(a)
    c = _request("c", _prompt(rng, 2))
    assert bm.allocate(c, 2)
    assert c.block_ids == [partial]
    again = _request("again", list(prompt))
    assert [blk.block_id for blk in bm.find_cached_prefix(again)] == full
    check_block_invariants(bm, [c])


def test_chained_hash_needs_the_same_parent() -> None:
    rng = random.Random(8)
    bm = BlockManager(16, BS, True)
    second = _prompt(rng, BS)
    a = _request("a", [*_prompt(rng, BS), *second, 5])
    _admit(bm, a)
    b = _request("b", [*_prompt(rng, BS), *second, 5])  # same second block, different first block
    assert bm.find_cached_prefix(b) == []


def test_prefix_caching_disabled() -> None:
    rng = random.Random(9)
    bm = BlockManager(16, BS, False)
    prompt = _prompt(rng, 10)
    a = _request("a", prompt)
    _admit(bm, a)
    assert not bm.cached_blocks()
    assert bm.find_cached_prefix(_request("b", list(prompt))) == []
    assert bm.prefix_cache_hit_rate == 0.0


def test_reset_prefix_cache_forgets_every_prefix() -> None:
    rng = random.Random(10)
    bm = BlockManager(16, BS, True)
    prompt = _prompt(rng, 10)
    a = _request("a", prompt)
    _admit(bm, a)
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(_request("b", list(prompt))) == []
    check_block_invariants(bm, [a])


def test_blocks_of_a_failed_step_leave_the_cache() -> None:
    """Regression: hashes registered while planning a step that then failed or was interrupted stayed in the
    index, pointing at blocks whose KV was never written; a later request with the same prefix read garbage."""
    rng = random.Random(11)
    bm = BlockManager(16, BS, True)
    a = _request("a", _prompt(rng, 9))
    assert bm.allocate(a, 9)  # planned: two full blocks registered, pending
    assert len(bm.cached_blocks()) == 2
    bm.discard_pending()  # the step never ran
    assert not bm.cached_blocks() and all(bm.blocks[i].block_hash is None for i in a.block_ids)
    bm.free(a)
    b = _request("b", list(a.prompt_token_ids))
    assert bm.find_cached_prefix(b) == []
    check_block_invariants(bm, [])


def test_same_step_admissions_share_a_prefix() -> None:
    """Blocks registered while planning are visible to requests admitted later in the same step (each layer
    stores the step's KV before attending), so a burst of prompts with one system prompt computes it once."""
    rng = random.Random(13)
    bm = BlockManager(32, BS, True)
    shared = _prompt(rng, 12)
    a = _request("a", [*shared, *_prompt(rng, 3)])
    b = _request("b", [*shared, *_prompt(rng, 5)])
    assert bm.allocate(a, a.num_tokens)
    hits = bm.find_cached_prefix(b)  # same step, before commit
    assert len(hits) == 3 and [h.block_id for h in hits] == a.block_ids[:3]
    assert bm.allocate(b, b.num_tokens - 12, hits)
    bm.commit_pending()
    check_block_invariants(bm, [a, b])


def test_registration_follows_chunks_and_decodes() -> None:
    rng = random.Random(12)
    bm = BlockManager(16, BS, True)
    c = _request("c", _prompt(rng, 6))
    assert bm.allocate(c, 3)  # chunk 1: no full block yet
    c.num_computed_tokens = 3
    bm.commit_pending()
    assert not bm.cached_blocks()
    assert bm.allocate(c, 3)  # chunk 2: block 0 full
    c.num_computed_tokens = 6
    bm.commit_pending()
    assert len(c.block_ids) == 2 and len(bm.cached_blocks()) == 1
    for token in _prompt(rng, 2):  # decode two tokens: block 1 fills
        c.append_token(token)
        assert bm.allocate(c, 1)
        c.num_computed_tokens += 1
        bm.commit_pending()
    assert len(bm.cached_blocks()) == 2
    check_block_invariants(bm, [c])


def test_block_hashes_cover_full_64_bit_digests() -> None:
    """Regression: parents are unsigned 64-bit digests; packing them signed overflowed on half of them."""
    rng = random.Random(12)
    tokens = _prompt(rng, 64 * BS)
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BS, 64)
    assert len(set(hashes)) == 64
    assert any(h >= 2**63 for h in hashes)
    assert hashes[1] == hash_block(hash_block(ROOT_HASH, tokens[:BS]), tokens[BS : 2 * BS])
