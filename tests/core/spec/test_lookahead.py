"""`reserve_lookahead`: a draft model's positions past a step are reserved only from blocks nobody else is owed:
the running requests' next tokens and the blocks promised to requests whose prefixes the step restores
(`BlockManager.stage`) come first."""

from __future__ import annotations

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request
from asyncllm.core.spec.draft_proposals import reserve_lookahead
from asyncllm.sampling_params import SamplingParams

BS = 4


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(), arrival_time=0.0, max_tokens=8)


def _computed(bm: BlockManager, request: Request) -> None:
    assert bm.allocate(request, request.num_tokens, bm.find_cached_prefix(request))
    request.num_computed_tokens = request.num_tokens
    bm.commit_pending()


def _pool_with_a_staged_request() -> tuple[BlockManager, Request]:
    """8 blocks: a computed 8-token prompt (2 blocks), a request staged on its prefix owed 2 more blocks, and a
    running 4-token request (1 block): 5 free, 2 of them promised."""
    bm = BlockManager(8, BS, True)
    shared = list(range(1, 9))
    _computed(bm, _request("a", shared))
    staged = _request("b", shared + list(range(20, 28)))
    cached = bm.find_cached_prefix(staged)
    assert len(cached) == 2 and bm.stage(staged, 8, cached)
    running = _request("c", [50, 51, 52, 53])
    _computed(bm, running)
    assert bm.num_free_blocks == 5 and bm.num_unpromised_blocks == 3
    return bm, running


def test_lookahead_leaves_the_promised_blocks_and_the_running_requests_next_ones() -> None:
    bm, running = _pool_with_a_staged_request()
    reserve_lookahead(bm, running, running.num_tokens, lookahead=8, keep_free=2)  # wants 2 blocks: 1 would be left
    assert len(running.block_ids) == 1 and bm.num_unpromised_blocks == 3


def test_lookahead_takes_blocks_when_enough_are_unpromised() -> None:
    bm, running = _pool_with_a_staged_request()
    reserve_lookahead(bm, running, running.num_tokens, lookahead=8, keep_free=1)
    assert len(running.block_ids) == 3 and bm.num_unpromised_blocks == 1
