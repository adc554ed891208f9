"""WindowedBlockManager: a running request gives back the blocks wholly behind the sliding window of the next
token it computes, and only those; the rest of the accounting (free, preemption, prefix hits, n > 1 samples)
is the block manager's as before."""

from __future__ import annotations

import random

import pytest

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request
from asyncllm.core.sample_group import SampleGroup
from asyncllm.core.scheduler import Scheduler, SchedulerLimits
from asyncllm.core.window_blocks import WindowedBlockManager
from asyncllm.sampling_params import SamplingParams
from tests.core.invariants import check_block_invariants

BS, WINDOW = 4, 6


def _request(rid: str, prompt: list[int], max_tokens: int = 40, n: int = 1) -> Request:
    return Request(rid, prompt, SamplingParams(n=n), arrival_time=0.0, max_tokens=max_tokens)


def _run(bm: BlockManager, request: Request, steps: list[int]) -> list[int]:
    """Computes `steps` tokens at a time (prompt chunks, then decodes); the live block count after each."""
    live = []
    for n in steps:
        assert bm.allocate(request, n)
        request.num_computed_tokens += n
        while request.num_tokens < request.num_computed_tokens + 1:
            request.append_token(7)
        bm.commit_pending()
        check_block_invariants(bm, [request])
        live.append(len(bm.held_block_ids(request)))
    return live


def test_blocks_behind_the_window_go_back_and_no_others() -> None:
    """Position p's query sees keys p - 5..p: before computing position c, blocks ending at or before
    c - 5 are dead. The table keeps every entry (token t in entry t // 4); only the tail is referenced."""
    bm = WindowedBlockManager(16, BS, True, WINDOW)
    request = _request("a", list(range(1, 11)))
    live = _run(bm, request, [10] + [1] * 12)
    # Before computing position 10 (keys 5..10), block 0 (positions 0-3) is dead and block 1 (4-7) is not;
    # before 13 (keys 8..13) block 1 is; before 21 (keys 16..21) blocks 0-3 are.
    assert live == [3, 2, 2, 3, 2, 2, 2, 3, 2, 2, 2, 3, 2]
    assert len(request.block_ids) == -(-22 // BS)  # entries for every position, given-back ones included
    assert bm.num_free_blocks == 16 - live[-1]
    bm.free(request)
    assert request.block_ids == [] and bm.num_free_blocks == 16
    check_block_invariants(bm, [])


def test_given_back_blocks_stay_cached_for_a_later_prefix_hit() -> None:
    bm = WindowedBlockManager(32, BS, True, WINDOW)
    prompt = list(range(1, 30))
    a = _request("a", prompt)
    _run(bm, a, [8, 8, 8, 5, 1, 1])
    assert len(bm.held_block_ids(a)) < len(a.block_ids), "a gave blocks back"
    b = _request("b", prompt)
    hits = bm.find_cached_prefix(b)
    assert [h.block_id for h in hits] == a.block_ids[:7], "its whole prompt, given-back blocks included"
    assert bm.allocate(b, b.num_tokens - 7 * BS, hits)
    check_block_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    check_block_invariants(bm, [])
    assert bm.num_free_blocks == 32


def test_samples_of_one_request_keep_their_shared_prompt() -> None:
    """n > 1: the samples share their prompt's blocks through their group; none is given back early."""
    bm = WindowedBlockManager(32, BS, True, WINDOW)
    parent = _request("p", list(range(1, 23)), n=2)
    sample = SampleGroup(parent, BS).samples[0]
    live = _run(bm, sample, [22, 1, 1, 1, 1])
    assert live == [6, 6, 6, 7, 7]


def test_scheduler_runs_a_long_sequence_in_a_window_of_memory() -> None:
    """Six blocks hold 24 tokens; a 60-token sequence runs to the end without preemption, as the window (6)
    plus a chunk fit, and every block is free afterwards."""
    bm = WindowedBlockManager(6, BS, True, WINDOW)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=8), bm)
    request = _request("a", [random.Random(0).randrange(1, 100) for _ in range(20)], max_tokens=40)
    sched.add_request(request, seed=0)
    for _ in range(100):
        out = sched.schedule()
        if out.is_empty:
            break
        bm.commit_pending()
        check_block_invariants(bm, sched.running)
        sched.update_from_output(out, [5] * sum(s.sample for s in out.seqs))
        if request.num_output_tokens >= request.max_tokens:
            sched.finish_request("a", "length")
    assert request.num_output_tokens == 40 and sched.num_preemptions == 0
    assert bm.num_free_blocks == 6


def test_rejects_a_bad_window() -> None:
    with pytest.raises(ValueError, match="window >= 1"):
        WindowedBlockManager(4, BS, True, 0)
