"""Blocks read from the disk tier are restored to the device as they arrive, while the rest of their request's
reads are out (`BlockManager.take_transfers`), over the token-id fake of tests/fixtures/fake_tiers.py: the
returning turns' tokens are a recompute's, the restores overlap the reads, and a device pool too small for all
the arrivals at once still serves every request exactly (the rest wait, or come back through the host tier).
Then both tiers under random sizes, speeds and scheduling (hypothesis)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.core.engine_core import EngineCore
from asyncllm.core.request import Request
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from tests.core.test_kv_tiers import DEVICE, _converse, _run, _turns, _want, kept_on_disk
from tests.fixtures.fake_executor import make_engine_core
from tests.fixtures.fake_tiers import TieredFakeExecutor, tiered_runtime


def _served(core: EngineCore, executor: TieredFakeExecutor, requests: list[Request]) -> None:
    """Add `requests`, run them to the end (the accounting checked every step), and check each gives the tokens
    of a run that recomputes its whole sequence."""
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[int]] = {}
    _run(core, outputs)
    assert all(outputs[r.request_id] == _want(executor, r) for r in requests)


def _restart(
    overlap: bool, num_kv_blocks: int, returning: int = 3, loads_per_step: int = 3, **executor_kwargs: int
) -> tuple[EngineCore, TieredFakeExecutor, list[Request]]:
    """Two turns of three conversations kept on disk by an engine that stopped; a new engine on that disk
    (`num_kv_blocks` on its device, starting `loads_per_step` reads a step) with the third turn's requests of
    the first `returning` conversations added, nothing stepped yet."""
    turns = _turns(3, 3, seed=11)
    disk, histories, _ = kept_on_disk(turns)
    device = DEVICE | {"num_kv_blocks": num_kv_blocks}
    runtime = tiered_runtime(64, disk=disk, loads_per_step=loads_per_step, **device)
    executor = TieredFakeExecutor(runtime, disk=disk, asynchronous=overlap, **executor_kwargs)  # type: ignore[arg-type]
    core = make_engine_core(executor, max_num_batched_tokens=32, async_scheduling=overlap)
    ip = InputProcessor(executor.runtime, None)
    requests = [
        ip.make_request(f"back{c}", histories[c] + new, SamplingParams(max_tokens=5), 0.0)
        for c, new in enumerate(turns[2][:returning])
    ]
    for request in requests:
        core.add_request(request)
    return core, executor, requests


@pytest.mark.parametrize("overlap", [False, True])
def test_blocks_read_from_disk_are_restored_while_the_rest_are_read(overlap: bool) -> None:
    """One returning conversation whose reads finish one a step: its first blocks cross to the device while
    its last are still being read."""
    core, executor, requests = _restart(overlap, num_kv_blocks=64, returning=1, read_steps=2, reads_per_report=1)
    outputs: dict[str, list[int]] = {}
    _run(core, outputs)
    assert all(outputs[r.request_id] == _want(executor, r) for r in requests)
    assert executor.steps_restoring_while_reading > 0
    stats = core.stats()
    # Every block read came back to the device and counts as a disk hit once, when its request took it.
    assert stats.prefix_cache_disk_hit_tokens == 4 * len(executor.loaded_hashes) > 0
    assert stats.prefix_cache_host_hit_tokens == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_device_pool_smaller_than_the_arrivals_still_serves_them_exactly(overlap: bool) -> None:
    """16 device blocks, three histories of ~7 blocks each read in one step: not every arrival fits on the
    device ahead of its request; those wait, or are restored from the host tier when their request comes (no
    arrival undoes another's restore: the fake fails a step that restores into one block twice). The tokens are
    a recompute's either way."""
    core, executor, requests = _restart(overlap, num_kv_blocks=16, loads_per_step=64)
    outputs: dict[str, list[int]] = {}
    _run(core, outputs)
    assert all(outputs[r.request_id] == _want(executor, r) for r in requests)
    assert executor.copies["restores"] > len(executor.loaded_hashes)  # some came back through the host tier
    stats = core.stats()  # and each still counts as a disk hit: it was read from disk for this request
    assert stats.prefix_cache_disk_hit_tokens == 4 * len(executor.loaded_hashes) > 0
    assert stats.prefix_cache_host_hit_tokens == 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("ahead_blocks", [1, 256])
def test_arrivals_into_a_device_of_cached_blocks_with_a_full_host_tier(overlap: bool, ahead_blocks: int) -> None:
    """Regression (issue 44 review): a restart with 8 host slots, its device's free blocks all cached by a
    fresh request, two returning conversations whose reads fill every slot. Restoring one arrival took a cached
    block whose copy down reused a later arrival's host slot, and the next restore failed (KeyError) inside the
    scheduler. Arrivals now keep their slots, and take only free blocks whose reuse copies nothing down."""
    turns = _turns(3, 3, seed=11)
    disk, histories, _ = kept_on_disk(turns)
    device = DEVICE | {"num_kv_blocks": 16}
    runtime = tiered_runtime(8, ahead_blocks=ahead_blocks, disk=disk, **device)
    executor = TieredFakeExecutor(runtime, disk=disk, asynchronous=overlap)
    core = make_engine_core(executor, max_num_batched_tokens=64, async_scheduling=overlap)
    ip = InputProcessor(executor.runtime, None)
    fresh = ip.make_request("fresh", [60 - (i % 50) for i in range(63)], SamplingParams(max_tokens=1), 0.0)
    core.add_request(fresh)
    _run(core, {})
    requests = [
        ip.make_request(f"back{c}", histories[c] + turns[2][c], SamplingParams(max_tokens=5), 0.0) for c in range(2)
    ]
    _served(core, executor, requests)
    assert core.stats().prefix_cache_disk_hit_tokens > 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    host_blocks=st.integers(4, 40),
    num_kv_blocks=st.integers(20, 40),
    read_steps=st.integers(1, 3),
    reads_per_report=st.one_of(st.none(), st.integers(1, 4)),
    loads_per_step=st.integers(1, 64),
    restores_per_step=st.integers(0, 6),
    overlap=st.booleans(),
    returning=st.integers(1, 3),
)
def test_restarts_under_random_pressure_give_a_recomputes_tokens(
    seed: int,
    host_blocks: int,
    num_kv_blocks: int,
    read_steps: int,
    reads_per_report: int | None,
    loads_per_step: int,
    restores_per_step: int,
    overlap: bool,
    returning: int,
) -> None:
    """After a restart, any host tier, device pool, read speed, report size, restore bound and scheduling: the
    returning turns (and a fresh request beside them) give a recompute's tokens, the block accounting holds after
    every step (`_run`), and the fake's ordering checks pass."""
    rng = random.Random(seed)
    turns = _turns(3, 3, seed=seed)
    disk, histories, _ = kept_on_disk(turns)
    device = DEVICE | {"num_kv_blocks": num_kv_blocks}
    runtime = tiered_runtime(
        host_blocks, disk=disk, loads_per_step=loads_per_step, restores_per_step=restores_per_step, **device
    )
    executor = TieredFakeExecutor(
        runtime, disk=disk, asynchronous=overlap, read_steps=read_steps, reads_per_report=reads_per_report
    )
    core = make_engine_core(executor, max_num_batched_tokens=32, async_scheduling=overlap)
    ip = InputProcessor(executor.runtime, None)
    requests = [
        ip.make_request(f"back{c}", histories[c] + turns[2][c], SamplingParams(max_tokens=5), 0.0)
        for c in rng.sample(range(3), returning)
    ]
    requests.insert(
        rng.randrange(len(requests) + 1), ip.make_request("fresh", [5, 6, 7, 8, 9], SamplingParams(max_tokens=5), 0.0)
    )
    _served(core, executor, requests)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    host_blocks=st.integers(1, 40),
    num_kv_blocks=st.integers(20, 40),
    ahead_blocks=st.integers(0, 8),
    restores_per_step=st.integers(0, 6),
    overlap=st.booleans(),
)
def test_host_tier_conversations_under_random_pressure_give_a_recomputes_tokens(
    seed: int, host_blocks: int, num_kv_blocks: int, ahead_blocks: int, restores_per_step: int, overlap: bool
) -> None:
    """The host tier alone, any size, device pool, `ahead` budget, restore bound and scheduling: four turns of
    three conversations give a recompute's tokens (`_converse` checks each turn and the accounting every step)."""
    device = DEVICE | {"num_kv_blocks": num_kv_blocks}
    runtime = tiered_runtime(host_blocks, ahead_blocks=ahead_blocks, restores_per_step=restores_per_step, **device)
    executor = TieredFakeExecutor(runtime, asynchronous=overlap)
    core = make_engine_core(executor, max_num_batched_tokens=32, async_scheduling=overlap)
    _converse(core, executor, _turns(3, 4, seed=seed))
