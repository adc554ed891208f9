"""Tensor parallelism across real worker processes on CPU (gloo), against the one-process engine (its slow twin):
the same greedy tokens and `stats()` for every family of its own sharding under chunked prefill, preemption
and prefix hits (KV heads split, and replicated); the same tokens when steps feed PLACEHOLDER inputs, finish,
preempt and reuse ids; two engines side by side; a bad size refused before any process starts, a worker
failing at start-up reported with its traceback; a worker killed mid-stream failing every stream with
EngineDeadError within a second, leaving no process and no /dev/shm segment; workers gone with their
engine's process when it is killed; and a worker that loads no tokenizer unless a constraint needs one."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncllm import LLM, AsyncLLMEngine, EngineDeadError, SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidConfigError
from asyncllm.executor.multiproc import MultiProcExecutor
from asyncllm.executor.uniproc import UniProcExecutor
from asyncllm.executor.worker_procs import WorkerDiedError
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.step import PLACEHOLDER, ModelExecutor, NewRequestData, ScheduledSeq, SchedulerOutput
from tests.fixtures.shm import ring_segments
from tests.fixtures.tiny_models import FAMILIES, build_checkpoint

pytestmark = pytest.mark.slow  # starts processes or servers: seconds each

# 16 blocks of 4 tokens for six prompts sharing a 13-token prefix, 8 tokens per step: chunked prefill,
# preemption, and prefix hits (the second pass hits the first's blocks).
# 14 blocks: the sliding-window Mistral, which gives blocks back behind its window, preempts too.
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=8
)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def worker_processes(parent: int | None = None) -> set[int]:
    """Live tensor-parallel worker processes started by `parent` (this process by default)."""
    parent = os.getpid() if parent is None else parent
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(b")") + 2 :].split()[:2]
        if int(ppid) == parent and state not in (b"Z", b"X") and b"asyncllm.executor.worker_main" in cmdline:
            found.add(int(entry))
    return found


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Every test ends with no worker process and no ring segment of its own."""
    before = ring_segments(os.getpid())
    yield
    deadline = time.monotonic() + 5
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_processes() == set(), "a worker process outlived its engine"
    assert ring_segments(os.getpid()) - before == set(), "a ring segment outlived its engine"


def _prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(13)]
    return [prefix + [rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 17, 9, 30, 3)]


def _two_passes(path: Path, **args: Any) -> tuple[list[list[int]], dict[str, float | int]]:
    llm = LLM(str(path), **ENGINE_ARGS, **args)
    try:
        tokens = [o.token_ids for _ in range(2) for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
        return tokens, llm.stats()
    finally:
        llm.shutdown()


def _check_tp2_equals_tp1(path: Path) -> None:
    want_tokens, want_stats = _two_passes(path)
    tokens, stats = _two_passes(path, tensor_parallel_size=2)
    assert tokens == want_tokens
    assert stats == want_stats  # the same schedule, hence the same preemptions, hits and steps
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0.3
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


# Every family but two whose sharding is another's: Mistral without a window is Llama's class and maths, and
# Llama's layers (untied head, head_dim = hidden / heads, plain rope) are Qwen2's without the qkv bias; llama3
# runs the same class with a tied head. Each tensor-parallel engine starts a worker interpreter (seconds).
TP_FAMILIES = sorted(set(FAMILIES) - {"llama", "mistral"})


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp2_equals_tp1(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Greedy tokens and stats of TP=2 (KV heads split) equal TP=1's, chunked, preempted and prefix-cached."""
    _check_tp2_equals_tp1(tiny_checkpoints[family])


def test_tp2_fp8_kv_cache_equals_tp1(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """kv_cache_dtype="fp8": each rank stores its KV heads as e4m3 with the checkpoint's scales, replicated (in
    ModelOpt's naming, under k_proj / v_proj: never sliced as those projections are)."""
    from tests.fixtures.kv_scales import with_kv_scales

    path = with_kv_scales(tiny_checkpoints["qwen3"], tmp_path / "scaled", [(0.37, 1.3), (2.9, 0.61)], "modelopt")
    want_tokens, want_stats = _two_passes(path, kv_cache_dtype="fp8")
    tokens, stats = _two_passes(path, kv_cache_dtype="fp8", tensor_parallel_size=2)
    assert (tokens, stats) == (want_tokens, want_stats)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0.3


def test_tp2_with_replicated_kv_heads_equals_tp1(tmp_path: Path) -> None:
    """One KV head over two ranks: each holds a replica; tokens and stats still equal TP=1's."""
    _check_tp2_equals_tp1(build_checkpoint(tmp_path / "qwen3-kv1", "qwen3", num_key_value_heads=1))


def _lora_run(path: Path, adapters: dict[str, Path], **args: Any) -> list[list[int]]:
    llm = LLM(str(path), **ENGINE_ARGS, enable_lora=True, max_loras=1, max_lora_rank=8, **args)
    try:
        for name in ("a", "c", "b"):
            llm.add_lora(name, adapters[name])
        llm.remove_lora("c")  # every rank forgets it
        prompts = _prompts()[:3] * 3
        loras = [name for name in ("a", "b", None) for _ in range(3)]
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora=loras)]
    finally:
        llm.shutdown()


def test_tp2_lora_equals_tp1(tiny_model: Path, tiny_lora_adapters: dict[str, Path]) -> None:
    """LoRA adapters over two ranks (a row-parallel layer's A and a column-parallel one's B sharded like their
    base weights; added and removed on every rank through the ring) give TP=1's tokens, one slot reloaded as
    the adapters take turns."""
    want = _lora_run(tiny_model, tiny_lora_adapters)
    assert _lora_run(tiny_model, tiny_lora_adapters, tensor_parallel_size=2) == want


def _scripted_run(executor: ModelExecutor) -> list[list[int]]:
    """Steps as overlapped scheduling plans them: PLACEHOLDER inputs fed on the device, a finished id reused
    by a new request in the same step as another request is preempted, and the preempted one resumed."""
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=50)
    a, b, c = [5, 9, 14, 3, 8, 21], [7, 7, 30, 2, 11, 40, 6, 12, 19], [17, 4, 22]
    outs: list[list[int]] = []

    def run(step: SchedulerOutput) -> list[int]:
        outs.append(executor.submit(step).result().sampled_token_ids)
        return outs[-1]

    new = [NewRequestData("a", a, greedy, 1), NewRequestData("b", b, sampled, 2), NewRequestData("c", c, sampled, 3)]
    run(SchedulerOutput([ScheduledSeq("a", a, 0, [0, 1], True), ScheduledSeq("b", b[:5], 0, [2, 3], False),
                         ScheduledSeq("c", c, 0, [4], True)], new))  # fmt: skip
    b_token = run(SchedulerOutput([ScheduledSeq("a", [PLACEHOLDER], 6, [0, 1], True),
                                   ScheduledSeq("b", b[5:], 5, [2, 3, 5], True),
                                   ScheduledSeq("c", [PLACEHOLDER], 3, [4], True)]))[1]  # fmt: skip
    c2 = [33, 1, 9, 27, 5]
    run(SchedulerOutput([ScheduledSeq("a", [PLACEHOLDER], 7, [0, 1], True), ScheduledSeq("c", c2, 0, [6, 7], True)],
                        [NewRequestData("c", c2, greedy, 4)], finished_request_ids=["c"],
                        preempted_request_ids=["b"]))  # fmt: skip
    run(SchedulerOutput([ScheduledSeq("a", [PLACEHOLDER], 8, [0, 1, 11], True),
                         ScheduledSeq("b", [*b, b_token], 0, [8, 9, 10], True),
                         ScheduledSeq("c", [PLACEHOLDER], 5, [6, 7], True)]))  # fmt: skip
    return outs


def test_scripted_steps_match_one_process(tiny_checkpoints: dict[str, Path]) -> None:
    """Driven directly through the executor protocol, TP=2 samples what one process samples, step by step.
    The worker reopens the checkpoint for its weights alone: with no constraint asked for, it never loads the
    tokenizer (its start-up once paid for transformers' import and the tokenizer, which only grammars read)."""
    path = str(tiny_checkpoints["qwen2"])
    checkpoint = open_checkpoint(path, torch.float32)
    args = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=32)
    single = UniProcExecutor(EngineConfig.from_kwargs(path, **args), checkpoint)
    want = _scripted_run(single)
    single.shutdown()
    tp = MultiProcExecutor(EngineConfig.from_kwargs(path, tensor_parallel_size=2, **args), checkpoint)
    try:
        assert tp.runtime.num_kv_blocks == 32 and len(tp.worker_pids) == 1
        assert _scripted_run(tp) == want
        (pid,) = tp.worker_pids
        assert "/tokenizers/" not in Path(f"/proc/{pid}/maps").read_text()  # the tokenizers library never loaded
    finally:
        tp.shutdown()
        tp.shutdown()  # idempotent


def test_two_engines_side_by_side(tiny_checkpoints: dict[str, Path]) -> None:
    """Two TP=2 engines in one process, generating at the same time, each give their TP=1 tokens; one is
    shut down, the other merely dropped (its finalizer stops the worker and removes the segment)."""
    paths = [tiny_checkpoints["qwen3"], tiny_checkpoints["llama"]]
    want = [_two_passes(p)[0][:6] for p in paths]
    engines = [LLM(str(p), tensor_parallel_size=2, **ENGINE_ARGS) for p in paths]
    got: list[list[list[int]] | None] = [None, None]

    def generate(i: int) -> None:
        got[i] = [o.token_ids for o in engines[i].generate(_prompts(), GREEDY, use_tqdm=False)]

    try:
        assert len(worker_processes()) == 2
        threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == want
    finally:
        engines.pop(0).shutdown()
        engines.clear()  # the last reference to the second engine
        gc.collect()


def test_bad_size_is_refused_before_any_process_starts(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(InvalidConfigError, match="tensor_parallel_size=3 does not divide the model's 4 attention"):
        LLM(str(tiny_checkpoints["qwen3"]), tensor_parallel_size=3, device="cpu")


def test_worker_failing_at_start_up_fails_the_constructor(tiny_checkpoints, tmp_path, monkeypatch) -> None:
    """A worker whose set-up raises (here: loading the model, made to fail in worker processes only through a
    sitecustomize on their path) fails the engine's constructor with WorkerDiedError carrying its traceback."""
    if importlib.util.find_spec("sitecustomize") is not None:
        pytest.skip("a sitecustomize module is already on the path")
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "if sys.argv[1:] and sys.argv[0] == '-c':  # a tensor-parallel worker: python -c ... SPEC_FD REPORT_FD\n"
        "    import asyncllm.worker.setup as w\n"
        "    def load(self):\n"
        "        raise MemoryError('injected: no memory on this rank')\n"
        "    w.WorkerSetup.load = load\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(WorkerDiedError, match="rank 1") as info:
        LLM(str(tiny_checkpoints["qwen3"]), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    assert "MemoryError: injected: no memory on this rank" in str(info.value)


async def test_killed_worker_kills_every_stream_within_a_second(tiny_checkpoints: dict[str, Path]) -> None:
    """SIGKILL the worker mid-stream: every stream raises EngineDeadError (cause: WorkerDiedError naming
    the signal) within 1 s, new requests fail at once, and shutdown leaves nothing behind."""
    engine = AsyncLLMEngine(str(tiny_checkpoints["qwen3"]), device="cpu", num_kv_blocks=256, tensor_parallel_size=2)
    (pid,) = worker_processes()
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    streams = [engine.add_request([i + 3, 5, 9], params) for i in range(4)]
    iterators = [s.__aiter__() for s in streams]
    for it in iterators:  # every stream has produced: we kill mid-stream
        assert (await asyncio.wait_for(it.__anext__(), 60)).token_ids

    async def drain(it: Any) -> None:
        async for _ in it:
            pass

    readers = [asyncio.create_task(drain(it)) for it in iterators]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    done, pending = await asyncio.wait(readers, timeout=1.0)
    assert not pending and time.monotonic() - start < 1.0
    for reader in done:
        error = reader.exception()
        assert isinstance(error, EngineDeadError) and isinstance(error.__cause__, WorkerDiedError)
        assert "SIGKILL" in str(error.__cause__)
    with pytest.raises(EngineDeadError):
        engine.add_request([1, 2, 3])
    await engine.aclose()


def test_shutdown_after_a_worker_death_does_not_wait_on_a_stuck_device(tiny_checkpoints, monkeypatch) -> None:
    """On a GPU, a kernel waiting on the dead peer can block rank 0's release of its device for good (a device-wide
    sync). Here rank 0's release is made to block like that: `LLM.shutdown` still returns within seconds, leaving
    it behind, and the dead worker is reaped."""
    from asyncllm.worker.worker import Worker

    llm = LLM(str(tiny_checkpoints["qwen3"]), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    (pid,) = worker_processes()
    stuck, release = threading.Event(), threading.Event()
    original = Worker.shutdown

    def blocking_release(self: Worker) -> None:
        stuck.set()
        release.wait(60)
        original(self)

    monkeypatch.setattr(Worker, "shutdown", blocking_release)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.monotonic()
    try:
        llm.shutdown()
        assert time.monotonic() - start < 8.0
        assert stuck.is_set()
    finally:
        release.set()
    assert not worker_processes()


async def test_idle_engine_learns_of_a_dead_worker_at_once(tiny_checkpoints: dict[str, Path]) -> None:
    """SIGKILL the worker while no request runs: the engine dies within a second (health checks raise, with the
    worker's death as the cause), not at the next request."""
    engine = AsyncLLMEngine(str(tiny_checkpoints["qwen3"]), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        await engine.generate([3, 4, 5], SamplingParams(max_tokens=2))
        await engine.check_health()
        (pid,) = worker_processes()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while True:
            try:
                await engine.check_health()
            except EngineDeadError as exc:
                assert isinstance(exc.__cause__, WorkerDiedError) and "SIGKILL" in str(exc.__cause__)
                break
            assert time.monotonic() < deadline, "the idle engine did not notice its dead worker"
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            engine.add_request([1, 2, 3])
    finally:
        await engine.aclose()
    assert not worker_processes()


def test_workers_exit_when_the_engine_process_is_killed(tiny_checkpoints: dict[str, Path]) -> None:
    """SIGKILL the process that owns a TP engine (a script with no `__main__` guard): its worker exits at once
    (it watches a pipe from it) and its ring segment is removed (the owner's resource tracker)."""
    script = (
        "import time\nfrom asyncllm import LLM\n"
        f"llm = LLM({str(tiny_checkpoints['qwen3'])!r}, device='cpu', num_kv_blocks=64, tensor_parallel_size=2)\n"
        "print('ready', flush=True)\ntime.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        workers = worker_processes(owner.pid)
        segments = ring_segments(owner.pid)
        assert len(workers) == 1 and len(segments) == 1
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 5
    while (worker_processes(owner.pid) or _alive(workers) or ring_segments(owner.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(workers), "a worker outlived its engine's process"
    assert not ring_segments(owner.pid), "the ring segment outlived its engine's process"


def test_workers_outlive_a_sigterm_to_the_process_group(tiny_checkpoints: dict[str, Path]) -> None:
    """A service manager's SIGTERM reaches every process of the group (systemd: the whole control group). The
    engine's owner decides what it means (`asyncllm serve` drains): its workers ignore it, so the engine still
    serves afterwards, and the workers still stop when the engine shuts down."""
    script = (
        "import signal, sys\nfrom asyncllm import LLM, SamplingParams\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('term', flush=True))\n"
        f"llm = LLM({str(tiny_checkpoints['qwen3'])!r}, device='cpu', num_kv_blocks=64, tensor_parallel_size=2)\n"
        "print('ready', flush=True)\nsys.stdin.readline()\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)\n"
        "print('generated', len(out[0].token_ids), flush=True)\nllm.shutdown()\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert owner.stdout is not None and owner.stdin is not None
        assert owner.stdout.readline().strip() == "ready"
        workers = worker_processes(owner.pid)
        assert len(workers) == 1
        os.killpg(owner.pid, signal.SIGTERM)
        assert owner.stdout.readline().strip() == "term"
        time.sleep(0.2)  # a worker that took the signal is gone by now
        assert _alive(workers), "a worker died of the group's SIGTERM"
        owner.stdin.write("\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "generated 4"
        assert owner.wait(timeout=30) == 0
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 5
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(workers), "a worker outlived its engine"


def _alive(pids: set[int]) -> bool:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X"):
            return True
    return False


def test_samples_over_tp2_equal_tp1(tiny_checkpoints: dict[str, Path]) -> None:
    """`n` samples sharing their prompt's blocks reach every rank as requests of their own: TP=2 gives TP=1's
    tokens and schedule under chunked prefill and preemption."""
    params = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=10, ignore_eos=True)
    prompts = _prompts()[:3]

    def run(**args: Any) -> tuple[list[list[list[int]]], dict[str, float | int]]:
        llm = LLM(str(tiny_checkpoints["qwen3"]), **ENGINE_ARGS, enable_prefix_caching=False, **args)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [[s.token_ids for s in o.outputs] for o in outs], llm.stats()
        finally:
            llm.shutdown()

    want, want_stats = run()
    got, stats = run(tensor_parallel_size=2)
    assert got == want and stats == want_stats
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_prompt_logprobs_over_tp2_equal_tp1(
    tiny_checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """The LM head over prompt rows gathers the vocabulary shards as sampling's does (every rank runs the same
    slices): TP=2 scores every prompt token as TP=1 does, under chunked prefill and preemption.

    Its TP=2 engine also answers a regression: the KV cache smaller than max_model_len was warned by every
    rank, the workers' copies bare (no logger, no rank). Rank 0 logs it once; a worker's own warnings would
    name their rank."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=3)
    prompts = _prompts()

    def run(**args: Any) -> tuple[list[Any], dict[str, float | int]]:
        llm = LLM(str(tiny_checkpoints["qwen3"]), **ENGINE_ARGS, **args)
        try:
            return [o.prompt_logprobs for o in llm.generate(prompts, params, use_tqdm=False)], llm.stats()
        finally:
            llm.shutdown()

    want, want_stats = run()
    capfd.readouterr()
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="asyncllm")
    got, stats = run(tensor_parallel_size=2)
    tokens = ENGINE_ARGS["num_kv_blocks"] * ENGINE_ARGS["block_size"]
    warned = [r for r in caplog.records if f"the KV cache holds {tokens} tokens" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    err = capfd.readouterr().err
    bare = [line for line in err.splitlines() if "KV cache holds" in line and "asyncllm" not in line]
    assert not bare and "asyncllm rank 1" not in err, err
    assert stats == want_stats and stats["num_preemptions"] > 0
    for prompt, g, w in zip(prompts, got, want):
        assert len(g) == len(w) == len(prompt) and g[0] is None
        for mine, theirs in zip(g[1:], w[1:]):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-5 for t in mine)
