"""The KV tiers below the device, as the engine core plans them (`core/kv_tiers.py`), over a FakeExecutor whose
"KV" is token ids and whose host pool and "disk" hold copies of it (`tests/fixtures/fake_tiers.py`): multi-turn
conversations whose histories the small device pool evicts come back from the host tier with the tokens of a
run that recomputes everything, serially and overlapped; after a restart from the disk tier; with reads that
fail (recomputed instead); never a LoRA adapter's block on disk; the step's copies through the tensor-parallel
codec. (Sliding windows: tests/test_kv_tiers_engine.py, on a real model: this fake reads every position.)"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from asyncllm.core import block_hash
from asyncllm.core.engine_core import EngineCore
from asyncllm.core.request import Request
from asyncllm.executor.step_codec import decode_kv, encode_kv
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import KVTransfers, LoRAAdapter, SchedulerOutput
from tests.core.invariants import check_block_invariants
from tests.fixtures.fake_executor import FakeExecutor, kv_token, make_engine_core, make_runtime, reference_tokens
from tests.fixtures.fake_tiers import Disk, TieredFakeExecutor, tiered_runtime

DEVICE = dict(num_kv_blocks=24, block_size=4, vocab_size=64, max_model_len=512)


def _turns(num_conversations: int, num_turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Per turn, per conversation, the user's new tokens (the history before them is the conversation so far)."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(1, 64) for _ in range(rng.randint(6, 14))] for _ in range(num_conversations)]
        for _ in range(num_turns)
    ]


def _converse(
    core: EngineCore,
    executor: FakeExecutor,
    turns: list[list[list[int]]],
    histories: list[list[int]] | None = None,
    lora_id: int = 0,
) -> list[list[int]]:
    """Run every turn of every conversation (a turn's requests together), checking each output against a run
    that recomputes its whole sequence, and the block accounting after every step. The final histories."""
    histories = [[] for _ in turns[0]] if histories is None else histories
    ip = InputProcessor(executor.runtime, None)

    def through_adapter(seq: list[int]) -> int:  # a request reads the "KV" its adapter computed (`kv_token`)
        return executor.next_token([kv_token(t, lora_id) for t in seq])

    for t, news in enumerate(turns):
        requests: list[Request] = []
        for c, new in enumerate(news):
            prompt = histories[c] + new
            request = ip.make_request(f"t{t}c{c}-{id(histories)}", prompt, SamplingParams(max_tokens=5), 0.0)
            request.lora_id = lora_id
            core.add_request(request)
            requests.append(request)
        outputs: dict[str, list[int]] = {}
        for _ in range(400):
            if not core.has_unfinished():
                break
            for delta in core.step():
                outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            live = list(core.scheduler.requests.values())
            check_block_invariants(core.block_manager, live, core.scheduler.held_block_ids())
        else:
            raise AssertionError("the turn did not finish")
        for c, request in enumerate(requests):
            want = reference_tokens(through_adapter, request.prompt_token_ids, 5, frozenset())
            assert outputs[request.request_id] == want, f"turn {t}, conversation {c}"
            histories[c] = request.prompt_token_ids + want
    return histories


def kept_on_disk(turns: list[list[list[int]]]) -> tuple[Disk, list[list[int]], TieredFakeExecutor]:
    """The first two of `turns` conversed by an engine that then stopped (shutting down flushes its free cached
    blocks down to disk): the disk, the histories, and that engine's executor."""
    disk: Disk = {}
    first = TieredFakeExecutor(tiered_runtime(64, disk=disk, **DEVICE), disk=disk)
    core = make_engine_core(first, max_num_batched_tokens=32)
    histories = _converse(core, first, turns[:2])
    core.shutdown()
    return disk, histories, first


@pytest.mark.parametrize("overlap", [False, True])
def test_evicted_conversations_come_back_from_the_host_tier(overlap: bool) -> None:
    turns = _turns(4, 4)
    plain = FakeExecutor(make_runtime(**DEVICE), asynchronous=overlap)
    plain_core = make_engine_core(plain, max_num_batched_tokens=32, async_scheduling=overlap)
    _converse(plain_core, plain, turns)
    executor = TieredFakeExecutor(tiered_runtime(64, **DEVICE), asynchronous=overlap)
    core = make_engine_core(executor, max_num_batched_tokens=32, async_scheduling=overlap)
    _converse(core, executor, turns)
    stats = core.stats()
    assert stats.prefix_cache_host_hit_tokens > 0 and stats.prefix_cache_disk_hit_tokens == 0
    # The hit rate's terms count the host's hits: more than the device alone served.
    assert stats.prefix_cache_hit_tokens > plain_core.stats().prefix_cache_hit_tokens
    assert stats.prefix_cache_hit_tokens >= stats.prefix_cache_host_hit_tokens
    assert executor.copies["restores"] * 4 == stats.prefix_cache_host_hit_tokens
    assert executor.copies["offloads"] + executor.copies["ahead"] > 0
    assert executor.num_steps < plain.num_steps  # restored prefixes are not recomputed chunk by chunk


@pytest.mark.parametrize("overlap", [False, True])
def test_no_forward_pass_writes_a_block_whose_ahead_copy_is_pending(overlap: bool) -> None:
    """Regression (issue 44 review): the `wait` that makes a forward pass wait for a pending `ahead` copy of a
    block it overwrites went untested (the fake landed each step's copies within it). The fake now lands them
    only at a later step that waits, and fails a forward pass that writes a block whose copy is in flight."""
    executor = TieredFakeExecutor(tiered_runtime(64, ahead_blocks=8, **DEVICE), asynchronous=overlap)
    _converse(make_engine_core(executor, max_num_batched_tokens=32, async_scheduling=overlap), executor, _turns(4, 4))
    waits = [s.kv for s in executor.steps if s.kv is not None and s.kv.wait and not (s.kv.offloads or s.kv.restores)]
    assert waits  # steps that wait for nothing but pending copies: the case `wait` exists for


def test_a_tiny_host_tier_still_gives_the_same_tokens() -> None:
    """Two slots: most offloads find every slot in use by the step, and skip; what is restored is right."""
    executor = TieredFakeExecutor(tiered_runtime(2, ahead_blocks=1, **DEVICE))
    _converse(make_engine_core(executor, max_num_batched_tokens=32), executor, _turns(3, 4, seed=3))


def test_a_restart_finds_the_conversations_on_disk() -> None:
    turns = _turns(3, 3, seed=1)
    disk, histories, first = kept_on_disk(turns)
    assert first.copies["writes"] == len(disk) > 0
    second = TieredFakeExecutor(tiered_runtime(64, disk=disk, **DEVICE), disk=disk)
    core = make_engine_core(second, max_num_batched_tokens=32)
    _converse(core, second, turns[2:], histories)
    stats = core.stats()
    assert stats.prefix_cache_disk_hit_tokens > 0
    assert second.copies["loads"] * 4 >= stats.prefix_cache_disk_hit_tokens


def test_failed_reads_are_recomputed() -> None:
    """A block whose read fails on some rank (a corrupted file) is recomputed, and never asked for again."""
    turns = _turns(3, 3, seed=2)
    disk, histories, _ = kept_on_disk(turns)
    broken = frozenset(list(disk)[::2])
    second = TieredFakeExecutor(tiered_runtime(64, disk=disk, **DEVICE), disk=disk, fail_loads=broken)
    core = make_engine_core(second, max_num_batched_tokens=32)
    _converse(core, second, turns[2:], histories)
    assert 0 < core.stats().prefix_cache_disk_hit_tokens < 4 * second.copies["loads"]
    _converse(core, second, _turns(3, 1, seed=9), histories)
    asked = [h for h in second.loaded_hashes if h in broken]
    assert asked and len(asked) == len(set(asked))  # a block whose read failed is not asked for again


def test_a_block_on_disk_under_another_prefixs_hash_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 44 review): a disk hit trusted the 64-bit chained hash alone. Here the second engine's
    histories differ from the first's in their first block, and their hashes are forced onto the first's: every
    block it looks up is on disk under its hash, holding another prefix's KV. Each read is a miss (the digest
    of its prefix differs), and the tokens are those of a run that recomputes."""
    turns = _turns(3, 3, seed=5)
    disk, histories, _ = kept_on_disk(turns)
    others = [[(t + 1) % 63 + 1 for t in h[:4]] + h[4:] for h in histories]  # another first block
    collide = {tuple(o[:4]): h[:4] for o, h in zip(others, histories, strict=True)}
    real = block_hash.hash_block
    monkeypatch.setattr(block_hash, "hash_block", lambda parent, ids: real(parent, collide.get(tuple(ids), ids)))
    second = TieredFakeExecutor(tiered_runtime(64, disk=disk, **DEVICE), disk=disk)
    core = make_engine_core(second, max_num_batched_tokens=32)
    _converse(core, second, turns[2:], others)
    assert second.foreign_reads > 0 and core.stats().prefix_cache_disk_hit_tokens == 0


def test_an_adapters_blocks_never_reach_the_disk() -> None:
    """LoRA adapter ids are one engine's: a block on an adapter's chain goes to the host tier only."""
    disk: Disk = {}
    executor = TieredFakeExecutor(tiered_runtime(64, disk=disk, **DEVICE, max_loras=1), disk=disk)
    executor.add_lora(LoRAAdapter(1, "adapter", "/nowhere"))  # the fake only records it
    core = make_engine_core(executor, max_num_batched_tokens=32)
    _converse(core, executor, _turns(3, 3, seed=4), lora_id=1)
    core.shutdown()
    assert core.stats().prefix_cache_host_hit_tokens > 0
    assert executor.copies["offloads"] + executor.copies["ahead"] > 0 and disk == {}


def _returning_turn(
    overlap: bool, read_steps: int = 1, restores_per_step: int = 0
) -> tuple[EngineCore, TieredFakeExecutor, list[Request]]:
    """Two turns of four conversations (their histories evicted to the host tier), then the third turn's
    requests added, nothing stepped yet: the core, its executor and those requests."""
    runtime = tiered_runtime(64, restores_per_step=restores_per_step, **DEVICE)
    executor = TieredFakeExecutor(runtime, asynchronous=overlap, read_steps=read_steps)
    core = make_engine_core(executor, max_num_batched_tokens=32, async_scheduling=overlap)
    histories = _converse(core, executor, _turns(4, 2, seed=6))
    ip = InputProcessor(executor.runtime, None)
    requests = []
    for c, new in enumerate(_turns(4, 1, seed=7)[0]):
        requests.append(ip.make_request(f"back{c}", histories[c] + new, SamplingParams(max_tokens=5), 0.0))
        core.add_request(requests[-1])
    return core, executor, requests


def _run(core: EngineCore, outputs: dict[str, list[int]]) -> None:
    for _ in range(400):
        if not core.has_unfinished():
            return
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        check_block_invariants(core.block_manager, core.scheduler.requests.values(), core.scheduler.held_block_ids())
    raise AssertionError("the requests did not finish")


def _first_user(steps: list[SchedulerOutput], block_id: int) -> str | None:
    """The request of the first sequence in `steps` on `block_id` (a block is another's once freed)."""
    return next((seq.request_id for s in steps for seq in s.seqs if block_id in seq.block_ids), None)


def _want(executor: FakeExecutor, request: Request) -> list[int]:
    return reference_tokens(executor.next_token, request.prompt_token_ids, 5, frozenset())


@pytest.mark.parametrize("overlap", [False, True])
def test_a_restoring_request_computes_only_from_the_next_step(overlap: bool) -> None:
    """A returning request's restores go out with one step, and it computes from a later one: no step computes
    on blocks it restores (the fake fails that step), and several requests restore in one step."""
    core, executor, requests = _returning_turn(overlap)
    first = len(executor.steps)
    outputs: dict[str, list[int]] = {}
    _run(core, outputs)
    assert all(outputs[r.request_id] == _want(executor, r) for r in requests)
    steps = executor.steps[first:]
    restoring = [s for s in steps if s.kv is not None and s.kv.restores]
    assert restoring and max(len(s.kv.restores) for s in restoring if s.kv is not None) > 4  # several requests
    for i, step in enumerate(steps):
        restored = {block_id for _, block_id in step.kv.restores} if step.kv is not None else set()
        later = [seq for s in steps[i + 1 :] for seq in s.seqs if restored & set(seq.block_ids)]
        assert not restored or later, "restored blocks no later step computes on"
    assert core.stats().prefix_cache_host_hit_tokens >= 4 * sum(len(s.kv.restores) for s in restoring if s.kv)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_bounded_step_restores_one_request_past_its_bound(overlap: bool) -> None:
    """`restores_per_step` (ASYNCLLM_KV_RESTORE_MIB_PER_STEP): a step restores at most that many blocks, past it
    only its first request's; the others wait for later steps, and every output is the recomputed one."""
    core, executor, requests = _returning_turn(overlap, restores_per_step=2)
    first = len(executor.steps)
    outputs: dict[str, list[int]] = {}
    _run(core, outputs)
    assert all(outputs[r.request_id] == _want(executor, r) for r in requests)
    steps = executor.steps[first:]
    restoring = 0
    for i, step in enumerate(steps):
        restored = {block_id for _, block_id in step.kv.restores} if step.kv is not None else set()
        if not restored:
            continue
        restoring += 1
        owners = {_first_user(steps[i + 1 :], block_id) for block_id in restored}
        assert len(restored) <= 2 or len(owners) == 1, f"step {i} restores {len(restored)} blocks for {owners}"
    assert restoring >= 3  # the unbounded run restores them in one or two steps (the test above)
    assert core.stats().prefix_cache_host_hit_tokens > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_an_abort_while_its_restore_is_in_flight_frees_its_blocks(overlap: bool) -> None:
    """A request aborted after the step that restores its prefix went out: its blocks go back (the next step's
    work comes after the copies), it is never computed, the others' tokens hold, and the host entries it was
    restoring from serve the same prefix again."""
    core, executor, requests = _returning_turn(overlap)
    core.step()
    kv = executor.submitted[-1].kv
    restored = {b for _, b in kv.restores} if kv is not None else set()
    staged = [r for r in requests if restored & set(r.block_ids)]
    assert staged, "the first step restores no request's prefix"
    victim = staged[0]
    assert core.abort(victim.request_id)[0].finish_reason == "abort"
    check_block_invariants(core.block_manager, core.scheduler.requests.values(), core.scheduler.held_block_ids())
    outputs: dict[str, list[int]] = {}
    _run(core, outputs)
    assert all(seq.request_id != victim.request_id for s in executor.steps for seq in s.seqs)
    assert all(outputs[r.request_id] == _want(executor, r) for r in requests if r is not victim)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    # The same prefix again: it hits the host entries the aborted request read (or the device's blocks).
    hits = core.stats().prefix_cache_hit_tokens
    again = InputProcessor(executor.runtime, None).make_request(
        "again", victim.prompt_token_ids, SamplingParams(max_tokens=5), 0.0
    )
    core.add_request(again)
    _run(core, outputs)
    assert outputs["again"] == _want(executor, again)
    assert core.stats().prefix_cache_hit_tokens > hits


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_preempted_before_its_restore_is_used_comes_back_exactly(overlap: bool) -> None:
    """Memory runs short in the step after a request's restores went out: it is the lowest-ranked running
    request, preempted before it computed, its blocks freed behind the copies; resumed, its tokens are right."""
    executor = TieredFakeExecutor(tiered_runtime(64, **{**DEVICE, "num_kv_blocks": 20}), asynchronous=overlap)
    core = make_engine_core(executor, max_num_batched_tokens=32, max_num_seqs=6, async_scheduling=overlap)
    histories = _converse(core, executor, _turns(6, 2, seed=8))
    ip = InputProcessor(executor.runtime, None)
    requests = [
        ip.make_request(f"back{c}", histories[c] + new, SamplingParams(max_tokens=12), 0.0)
        for c, new in enumerate(_turns(6, 1, seed=9)[0])
    ]
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[int]] = {}
    _run(core, outputs)
    for r in requests:
        assert outputs[r.request_id] == reference_tokens(executor.next_token, r.prompt_token_ids, 12, frozenset())
    computed: set[str] = set()
    preempted_staged = []  # running, and never computed: admitted with its restores, then preempted
    for step in executor.submitted:
        preempted_staged += [r for r in step.preempted_request_ids if r not in computed]
        computed |= {seq.request_id for seq in step.seqs}
    assert preempted_staged, "no request was preempted between its restores and its first step"


@pytest.mark.parametrize("overlap", [False, True])
def test_slow_disk_reads_run_beside_other_requests_steps(overlap: bool) -> None:
    """After a restart, reads that take several steps: the requests waiting for them let a new request go
    first, whose steps run while the reads are out; then they are restored, their tokens those of a recompute."""
    turns = _turns(3, 3, seed=1)
    disk, histories, _ = kept_on_disk(turns)
    executor = TieredFakeExecutor(
        tiered_runtime(64, disk=disk, **DEVICE), disk=disk, asynchronous=overlap, read_steps=4
    )
    core = make_engine_core(executor, max_num_batched_tokens=32, async_scheduling=overlap)
    ip = InputProcessor(executor.runtime, None)
    requests = [
        ip.make_request(f"back{c}", histories[c] + new, SamplingParams(max_tokens=5), 0.0)
        for c, new in enumerate(turns[2])
    ]
    requests.append(ip.make_request("fresh", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=5), 0.0))
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[int]] = {}
    _run(core, outputs)
    assert all(outputs[r.request_id] == _want(executor, r) for r in requests)
    assert core.stats().prefix_cache_disk_hit_tokens > 0
    assert executor.steps_computing_while_reading > 0
    fresh_first = next(i for i, s in enumerate(executor.steps) if any(q.request_id == "fresh" for q in s.seqs))
    back_first = min(i for i, s in enumerate(executor.steps) for q in s.seqs if q.request_id.startswith("back"))
    assert fresh_first < back_first  # it arrived last, and went first


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVTransfers(),
        lambda: KVTransfers(
            [(3, 0), (7, 1)],
            [(2**64 - 1, 2, b"a" * 16), (5, 3, bytes(16))],
            [(4, 9)],
            [(1, 5)],
            [(2**63, 0, b"z" * 16)],
            True,
        ),
    ],
)
def test_transfers_cross_the_ring_whole(make: Callable[[], KVTransfers]) -> None:
    kv = make()
    assert decode_kv(encode_kv(kv)) == kv
