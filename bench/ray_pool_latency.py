"""What a `ReplicaPool` adds over a direct engine, on the CPU with stand-in cores: per request, per streamed
chunk, the front's CPU per token, and how fast a cancel reaches the replica.

The cores are the real engine core around the tests' fake executor, each step sleeping --step-ms with the
GIL released (as a step thread waiting on a GPU does), so every figure is the engine's and Ray's own work,
none of it a forward pass's. Step ends are stamped with time.monotonic() (one clock for every process on a
host), so a chunk's delivery latency is its arrival at the consumer less the end of the step that made it.

  request   sequential generate(max_tokens=1): round trip, direct engine and pools of 1 and 2 replicas
  chunk     one stream, then --streams at once, on one replica: delivery latency per token
  front     --streams streams of --tokens tokens: CPU of the caller's process per token delivered
  prefix    W3-like traffic (--prefixes shared prompts of 256 tokens, 16 requests each, all at once): the
            prefix-cache hit rate of one engine and of a pool of 2
  death     a replica's process killed (SIGKILL) under a running stream: until that stream raises
            EngineDeadError, and until the replacement takes requests (pool of 2)
  cancel    task.cancel() of a running stream: the replica's steps that end after it, and the time until it
            is gone

python bench/ray_pool_latency.py [--step-ms 5] [--requests 200] [--streams 64] [--tokens 128] [--prefixes 16]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.fixtures: the fake core, imported by the replicas too

from asyncllm import AsyncLLMEngine, SamplingParams  # noqa: E402
from tests.fixtures.fake_core import FakeBuilt, fake_built  # noqa: E402


def timed_core(step_s: float, stamps: str | None = None) -> FakeBuilt:
    """A fake core whose steps sleep `step_s` and stamp their end (appended to the file `stamps`, per
    process, when given; else kept in `built.stamps`)."""
    built = fake_built(None, step_delay=step_s, max_model_len=4096, num_kv_blocks=4096)
    executor, run = built.executor, built.executor.execute_model
    log = open(f"{stamps}.{os.getpid()}", "a", buffering=1) if stamps else None  # noqa: SIM115
    ends: list[float] = []
    built.stamps = ends  # type: ignore[attr-defined]

    def execute(scheduled: Any) -> Any:
        out = run(scheduled)
        now = time.monotonic()
        ends.append(now)
        if log is not None:
            log.write(f"{now!r}\n")
        return out

    executor.execute_model = execute  # type: ignore[method-assign]
    return built


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def ms(values: list[float]) -> dict[str, float]:
    return {"p50": round(1e3 * pct(values, 50), 3), "p99": round(1e3 * pct(values, 99), 3)}


async def round_trips(engine: AsyncLLMEngine, n: int) -> list[float]:
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(10):  # warm-up
        await engine.generate([1, 2, 3 + i], one)
    times = []
    for i in range(n):
        start = time.monotonic()
        await engine.generate([7, 8, 9 + i % 300], one)
        times.append(time.monotonic() - start)
    return times


async def arrivals(engine: AsyncLLMEngine, streams: int, tokens: int) -> list[list[float]]:
    """Each stream's arrival time per token (a merged chunk's tokens all arrive with it)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    async def one(i: int) -> list[float]:
        got: list[float] = []
        async for chunk in engine.stream([11 + i % 300, 12, 13], params):
            got += [time.monotonic()] * len(chunk.token_ids)
        return got

    return await asyncio.gather(*(one(i) for i in range(streams)))


def delivery(arrived: list[list[float]], ends: list[float]) -> list[float]:
    """Token k of every stream came from the k-th step since they started together (all fit one step)."""
    first = len(ends) - len(arrived[0])
    return [t - ends[first + k] for stream in arrived for k, t in enumerate(stream)]


def replica_ends(stamps: str, remove: bool = False) -> list[float]:
    ends: list[float] = []
    for path in Path(stamps).parent.glob(Path(stamps).name + ".*"):
        ends += [float(line) for line in path.read_text().split()]
        if remove:
            path.unlink()
    return sorted(ends)


async def measure_engine(args: argparse.Namespace, step_s: float) -> dict[str, Any]:
    built = timed_core(step_s)
    out: dict[str, Any] = {}
    async with AsyncLLMEngine.from_builder(lambda: built) as engine:
        out["request"] = ms(await round_trips(engine, args.requests))
        for streams in (1, args.streams):
            built.stamps.clear()  # type: ignore[attr-defined]
            got = await arrivals(engine, streams, args.tokens)
            out[f"chunk_{streams}"] = ms(delivery(got, built.stamps))  # type: ignore[attr-defined]
        cpu = time.process_time()
        got = await arrivals(engine, args.streams, args.tokens)
        out["front_cpu_us_per_token"] = round(1e6 * (time.process_time() - cpu) / sum(map(len, got)), 2)
        out["prefix_hit_rate"] = await hit_rate(engine, args.prefixes, seed=5)
    return out


async def measure_pool(args: argparse.Namespace, step_s: float, replicas: int, stamps: str) -> dict[str, Any]:
    from asyncllm.ray import ReplicaPool

    build = functools.partial(timed_core, step_s, stamps)
    pool = ReplicaPool.from_builder(build, num_replicas=replicas, ray_actor_options={"num_cpus": 0})
    out: dict[str, Any] = {}
    async with pool:
        out["request"] = ms(await round_trips(pool, args.requests))
        if replicas == 1:
            for streams in (1, args.streams):
                seen = len(replica_ends(stamps))
                got = await arrivals(pool, streams, args.tokens)
                await asyncio.sleep(0.2)  # the last stamps reach the file
                out[f"chunk_{streams}"] = ms(delivery(got, replica_ends(stamps)[seen:]))
            cpu = time.process_time()
            got = await arrivals(pool, args.streams, args.tokens)
            out["front_cpu_us_per_token"] = round(1e6 * (time.process_time() - cpu) / sum(map(len, got)), 2)
            out["cancel"] = await cancel_steps(pool, step_s, stamps)
        else:
            out["prefix_hit_rate"] = await hit_rate(pool, args.prefixes, seed=5)
            out["death"] = await death(pool)
    replica_ends(stamps, remove=True)
    return out


async def hit_rate(engine: AsyncLLMEngine, prefixes: int, seed: int) -> float:
    """W3's shape: `prefixes` prompts of 256 shared tokens, 16 requests each with its own 32-token tail."""
    import random

    rng = random.Random(seed)
    shared = [[rng.randrange(1, 384) for _ in range(256)] for _ in range(prefixes)]
    prompts = [[*p, *(rng.randrange(1, 384) for _ in range(32))] for p in shared for _ in range(16)]
    rng.shuffle(prompts)
    before = engine.stats()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    after = engine.stats()
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    return round((after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]) / queried, 4)


async def death(pool: Any, repeat: int = 3) -> dict[str, Any]:
    import signal

    from asyncllm.errors import EngineDeadError

    raised, back = [], []
    for _ in range(repeat):
        while pool.stats()["num_ready_replicas"] < 2:
            await asyncio.sleep(0.01)
        stream = pool.stream([31, 32], SamplingParams(max_tokens=2000, ignore_eos=True))
        await stream.__anext__()
        victim = next(r for r in pool.replica_stats() if r["num_running"])
        start = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        try:
            async for _ in stream:
                pass
        except EngineDeadError:
            raised.append(time.monotonic() - start)
        while not pool.replica_stats()[victim["index"]]["ready"]:
            await asyncio.sleep(0.005)
        back.append(time.monotonic() - start)
    return {"stream_raised_ms": ms(raised), "replacement_ready_s": round(statistics.median(back), 2)}


async def cancel_steps(pool: Any, step_s: float, stamps: str, repeat: int = 30) -> dict[str, Any]:
    """Cancel a running stream's task (alone on its replica, at different points of a step): the replica's
    steps that end after the cancel (1: only the step in flight, as in one engine), and the time until the
    pool reports the request gone."""
    steps, seconds = [], []
    for i in range(repeat):
        stream = pool.stream([21 + i, 22], SamplingParams(max_tokens=2000, ignore_eos=True))
        running = asyncio.Event()

        async def read(s: Any = stream, ready: asyncio.Event = running) -> None:
            async for _ in s:
                ready.set()

        task = asyncio.create_task(read())
        await running.wait()
        await asyncio.sleep(step_s * (1 + i % 3) / 3)  # at different points of a step
        task.cancel()
        start = time.monotonic()
        while pool.stats()["num_running"] or pool.num_live_requests:
            await asyncio.sleep(0.0005)
        seconds.append(time.monotonic() - start)
        await asyncio.sleep(0.05)  # the last stamps reach the file
        steps.append(sum(end > start for end in replica_ends(stamps)))
    counts = {n: steps.count(n) for n in sorted(set(steps))}
    return {"steps_after_cancel": counts, "freed_ms": ms(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=5.0, help="each fake step's length (a GPU decode step)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prefixes", type=int, default=16, help="shared prompts in the prefix case")
    args = parser.parse_args()
    step_s = args.step_ms / 1e3
    import ray

    temp = tempfile.mkdtemp(prefix="ray")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    stamps = str(Path(tempfile.mkdtemp()) / "stamps")
    engine = asyncio.run(measure_engine(args, step_s))
    print(json.dumps({"path": "engine", "step_ms": args.step_ms, **engine}), flush=True)
    for replicas in (1, 2):
        pool = asyncio.run(measure_pool(args, step_s, replicas, stamps))
        added = {
            k: round(v["p50"] - engine[k]["p50"], 3) for k, v in pool.items() if isinstance(v, dict) and k in engine
        }
        print(json.dumps({"path": f"pool of {replicas}", **pool, "added_p50_ms": added}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
