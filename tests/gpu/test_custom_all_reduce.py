"""The custom all-reduce (one-shot over symmetric memory) on two GPUs, against NCCL, its slow twin.

Through `ParallelContext` in two spawned ranks: it is on; bfloat16 and float32 sums of every decode size equal
NCCL's bit for bit on both ranks, eager and replayed from CUDA graphs, with messages it must leave to NCCL
(above its buffer, float16) in the same graph; a second group set up and checked in the same processes after the
first closed. Through the engine: the same tokens with ASYNCLLM_TP_CUSTOM_ALL_REDUCE on and off (several TP engines in
this process, each with fresh workers: torch's per-process rendezvous counter differs between the ranks, which
`SequenceAlignedStore` absorbs); and a worker killed mid-stream leaves an engine whose shutdown still ends (its
kernels, waiting for the dead peer, are drained), checked in a child process that a hang cannot take down.
Runs on the device machine (bench/gpu_check.sh tptests); skipped with fewer than 2 GPUs."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import random
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

WORLD = 2
HIDDEN = 1024
ROWS = (1, 3, 8, 64, 256)  # decode batch sizes, 3 an odd one
CAPACITY = max(ROWS) * HIDDEN * 4  # float32 [256, 1024]


def _rank_main(rank: int, port: int, results: Any) -> None:
    try:
        results.put((rank, _check_rank(rank, port)))
    except BaseException:
        results.put((rank, [traceback.format_exc()]))


def _check_rank(rank: int, port: int) -> list[str]:
    """Every check of one rank, in the same order on both (collectives and captures must match); the
    failures, described."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    from asyncllm.distributed.parallel_state import ParallelContext

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=60))
    failures: list[str] = []
    for attempt in ("first", "second"):  # the second group's rendezvous meets after the first's
        custom = ParallelContext(PrefixStore(f"{attempt}-custom/", store), rank, WORLD, device, CAPACITY)
        nccl = ParallelContext(PrefixStore(f"{attempt}-nccl/", store), rank, WORLD, device)
        if not custom.custom_all_reduce:
            return [f"{attempt} group: the custom all-reduce is off (see the warning)"]
        failures += [f"{attempt} group: {f}" for f in _check_sums(custom, nccl)]
        custom.close()
        nccl.close()
    return failures


def _inputs(rank: int) -> list[torch.Tensor]:
    """Fresh random messages, different on each rank: every decode size in both dtypes, then two the custom
    path must leave to NCCL (above its buffer; float16, which its kernel does not sum)."""
    generator = torch.Generator(device="cuda")
    generator.manual_seed(7 + rank)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for rows in ROWS:
            out.append(torch.randn(rows, HIDDEN, generator=generator, device="cuda").to(dtype))  # [rows, hidden]
    out.append(torch.randn(max(ROWS) + 1, HIDDEN, generator=generator, device="cuda"))  # float32, 4 KiB too big
    out.append(torch.randn(8, HIDDEN, generator=generator, device="cuda").half())
    return out


def _check_sums(custom: Any, nccl: Any) -> list[str]:
    failures = []
    inputs = _inputs(custom.rank)
    for i, x in enumerate(inputs):
        got, want = x.clone(), x.clone()
        custom.all_reduce(got)
        nccl.all_reduce(want)
        everyone = nccl.all_gather(got.view(1, -1))  # [world, numel]
        if not torch.equal(got, want):
            failures.append(f"eager message {i} {tuple(x.shape)} {x.dtype}: differs from NCCL")
        if not bool((everyone == got.view(1, -1)).all()):
            failures.append(f"eager message {i}: the ranks hold different bits")
    # One graph through both paths in turn, each sum feeding the next kernel (ordering on the stream).
    statics = [x.clone() for x in inputs]
    for s in statics:
        custom.all_reduce(s)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for s in statics:
            custom.all_reduce(s)
            s.mul_(0.5)
            custom.all_reduce(s)
    for replay in range(2):  # a replay reuses the same buffer and signal flags
        for s, x in zip(statics, inputs):
            s.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for i, (s, x) in enumerate(zip(statics, inputs)):
            want = x.clone()
            nccl.all_reduce(want)
            want.mul_(0.5)
            nccl.all_reduce(want)
            if not torch.equal(s, want):
                failures.append(f"graph replay {replay}, message {i} {tuple(x.shape)} {x.dtype}: differs from NCCL")
    return failures


def test_custom_all_reduce_matches_nccl_eager_and_in_graphs() -> None:
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank_main, args=(r, store.port, results)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    reports: dict[int, list[str]] = {}
    try:
        for _ in range(WORLD):
            rank, failures = results.get(timeout=240)
            reports[rank] = failures
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(WORLD)) - set(reports))} reported nothing within 240 s")
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert reports == {r: [] for r in range(WORLD)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_tokens_are_the_same_with_and_without(
    dtype: str, tiny_checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At two ranks the custom sums are NCCL's bits, so the whole engine gives the same greedy and seeded
    tokens either way (CUDA graphs on), and start-up says the custom path is on."""
    path = str(tiny_checkpoints["llama"])
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 40, 17, 9)]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=16, ignore_eos=True) for i, t in enumerate((0, 0.8) * 2)]
    outs = []
    for custom in (True, False):
        monkeypatch.setenv("ASYNCLLM_TP_CUSTOM_ALL_REDUCE", str(int(custom)))
        with caplog.at_level(logging.INFO, logger="asyncllm.distributed.parallel_state"):
            caplog.clear()
            llm = LLM(path, device="cuda", dtype=dtype, tensor_parallel_size=2, num_kv_blocks=256)
        try:
            assert ("custom all-reduce on" in caplog.text) == custom, caplog.text
            assert llm.runtime.cuda_graph_sizes
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


_KILL_SCRIPT = r"""
import asyncio, logging, os, signal, sys, time
from asyncllm import AsyncLLMEngine, EngineDeadError, SamplingParams

def workers():
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat", "rb").read()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == os.getpid() and b"worker_main" in cmdline:
                found.append(int(entry))
    return found

async def main():
    engine = AsyncLLMEngine(
        sys.argv[1], device="cuda", dtype="bfloat16", num_kv_blocks=256, tensor_parallel_size=2,
    )  # ASYNCLLM_TP_CUSTOM_ALL_REDUCE set by the test
    (pid,) = workers()
    streams = [engine.add_request([i + 3, 5, 9], SamplingParams(ignore_eos=True)) for i in range(8)]  # to the limit
    iterators = [s.__aiter__() for s in streams]
    for it in iterators:
        await asyncio.wait_for(it.__anext__(), 120)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    for it in iterators:
        try:
            async for _ in it:
                pass
        except EngineDeadError:
            continue
        raise SystemExit("a stream ended without EngineDeadError")
    print(f"DEAD_IN {time.monotonic() - killed:.2f}", flush=True)
    start = time.monotonic()
    await engine.aclose()
    print(f"SHUTDOWN_OK {time.monotonic() - start:.2f}", flush=True)

logging.basicConfig(level=logging.INFO)
asyncio.run(main())
"""


@pytest.mark.parametrize("path", ["custom", "nccl"])
def test_shutdown_ends_after_a_worker_dies_mid_stream(tiny_checkpoints: dict[str, Path], path: str) -> None:
    """SIGKILL the worker while rank 0 replays decode graphs full of all-reduces: custom ones would wait for the
    dead rank for ever (no NCCL abort reaches them), NCCL ones until the abort. Every stream fails with
    EngineDeadError within a second and shutdown ends. In a child process: a hang fails this test only."""
    env = dict(os.environ, ASYNCLLM_TP_CUSTOM_ALL_REDUCE=str(int(path == "custom")))
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _KILL_SCRIPT, str(tiny_checkpoints["qwen3"]), path],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the engine did not shut down after its worker died (stderr tail: {str(exc.stderr)[-2000:]})")
    assert ("custom all-reduce on" in done.stderr) == (path == "custom"), done.stderr[-3000:]
    assert done.returncode == 0 and "SHUTDOWN_OK" in done.stdout, done.stderr[-3000:]
    dead_in = float(done.stdout.split("DEAD_IN")[1].split()[0])
    seconds = float(done.stdout.split("SHUTDOWN_OK")[1].split()[0])
    print(f"{path}: every stream failed {dead_in:.2f} s after the kill; shutdown took {seconds:.2f} s")
    assert dead_in < 1.0, f"streams learnt of the dead worker after {dead_in} s"
    assert seconds < 10, f"shutdown took {seconds} s"
