"""W2 with knobs: the W1 requests as concurrent `async for` streams on AsyncLLMEngine (the workload of
../shared/peers/w2_stream.py, same draws and the same measures), with engine arguments and the GIL switch
interval settable, so one device call can compare variants. Prints one JSON line: stream throughput, TTFT
and inter-token gap percentiles as consumers see them, event-loop lag (a 1 ms ticker).

    python bench/w2_stream.py [--shape qwen3-0.6b] [--streams 256] [--engine-arg NAME=VALUE ...]
        [--switch-interval SECONDS] [--device cuda] [--lag-trace] [--gpu-profile] [--host-timing]
        [--replicas N]

--replicas N streams through a `ReplicaPool` of N engines on a local Ray cluster (one GPU each; needs Ray)
instead of one engine: `--replicas 2 --streams 512` on two GPUs against the default on one (docs/ray.md).

--lag-trace adds where the loop stalled (lag_trace.py): the longest stalls, garbage collections, and the
most sampled thread stacks during stalls. --gpu-profile records the GPU's kernels (CUDA activity only, so the
host is slowed little) and adds how busy the GPU was over the streamed run, its idle gaps and the steps by
kind (gpu_timeline.py), to set beside w1_profile.py's W1: whether streams starve the GPU, and in what gaps.
--host-timing adds the step thread's wall and CPU time per step by phase (host_timing.py; also in W1's script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from engine_args import add_engine_arg_option, engine_kwargs
from host_timing import host_timing
from lag_trace import lag_trace
from shapes import write_shape_dir
from triton_compiles import triton_compiles
from w1_throughput import w1_requests

from asyncllm import AsyncLLMEngine, SamplingParams


def pct_ms(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 2) if xs else None


async def run(args: argparse.Namespace, extra: dict) -> dict:
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    prompts, params = w1_requests(max(256, args.streams))  # 256: W1's own draws
    prompts, params = prompts[: args.streams], params[: args.streams]
    engine_args = dict(device=args.device, load_format="dummy", max_model_len=args.max_model_len, **extra)
    if args.replicas:
        from asyncllm.ray import ReplicaPool

        engine: AsyncLLMEngine = ReplicaPool(str(model_dir), num_replicas=args.replicas, **engine_args)
    else:
        engine = AsyncLLMEngine(str(model_dir), **engine_args)
    async with engine:
        async for _ in engine.stream([1, 2, 3], SamplingParams(max_tokens=16)):
            pass
        ttft: list[float] = []
        itl: list[float] = []
        lags: list[float] = []
        lag_starts: list[float] = []  # when each tick began: the admission burst's ticks are told apart
        admitted: list[float] = []  # when each stream's add_request returned
        counts: list[int] = []
        done = asyncio.Event()

        tracing = lag_trace() if args.lag_trace else nullcontext()

        async def ticker() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)
                lag_starts.append(t)
                if trace is not None:
                    trace.beat()

        async def one(prompt: list[int], sp: SamplingParams) -> None:
            t0 = time.perf_counter()
            last: float | None = None
            k = 0
            stream = engine.stream(prompt, sp)  # add_request: the request is queued here, synchronously
            admitted.append(time.perf_counter())
            async for chunk in stream:
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append((now - last) / max(1, len(chunk.token_ids)))
                last = now
                k += len(chunk.token_ids)
            counts.append(k)

        profiling = _gpu_profiler(args.device) if args.gpu_profile else nullcontext()
        timing_cm = host_timing() if args.host_timing else nullcontext()
        with tracing as trace, triton_compiles() as compiles, profiling as prof, timing_cm as timing:
            tick = asyncio.create_task(ticker())
            t = start = time.perf_counter()
            await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
            seconds = time.perf_counter() - t
            done.set()
            await tick
    total = sum(counts)
    # The clients start every stream in one loop iteration, so the ticks overlapping those add_request calls
    # measure the burst of admissions; the ticks after the last one, the loop while the streams run.
    last_admitted = max(admitted, default=start)
    streaming_lags = [lag for lag, began in zip(lags, lag_starts) if began >= last_admitted]
    return {
        "workload": f"W2-stream-{args.streams}",
        "shape": args.shape,
        "replicas": args.replicas,
        "engine_args": extra,
        "switch_interval_s": sys.getswitchinterval(),
        "output_tokens": total,
        "seconds": round(seconds, 2),
        "tok_s": round(total / seconds, 1),
        "ttft_p50_ms": pct_ms(ttft, 0.5),
        "ttft_p99_ms": pct_ms(ttft, 0.99),
        "itl_p50_ms": pct_ms(itl, 0.5),
        "itl_p99_ms": pct_ms(itl, 0.99),
        "itl_p99_over_p50": round(pct_ms(itl, 0.99) / pct_ms(itl, 0.5), 2) if itl else None,  # type: ignore[operator]
        "loop_lag_p99_ms": pct_ms(lags, 0.99),
        "loop_lag_max_ms": round(max(lags) * 1000, 2) if lags else None,
        "admission_burst_ms": round((last_admitted - start) * 1000, 2),
        "loop_lag_max_after_admission_ms": round(max(streaming_lags) * 1000, 2) if streaming_lags else None,
        "triton_compiles_after_warmup": dict(compiles),
        **(trace.summary() if trace is not None else {}),
        **(_gpu_summary(prof, seconds) if prof is not None else {}),
        **(timing.summary() if timing is not None else {}),
    }


def _gpu_profiler(device: str):  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    # CUDA activity alone: the kernels, with little host overhead. On CPU (a smoke run) there is none to record.
    return profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU])


def _gpu_summary(prof, seconds: float) -> dict:  # type: ignore[no-untyped-def]
    """The streamed run's GPU timeline, as w1_profile.py reports W1's."""
    from gpu_timeline import gap_histogram, step_kinds, summarize
    from w1_profile import device_intervals

    intervals = device_intervals(prof.events())
    timeline = summarize(intervals)
    wall_us = seconds * 1e6
    return {
        "gpu_busy_fraction_of_wall": round(timeline.busy_us / wall_us, 4),
        "gpu_idle_ms": round((wall_us - timeline.busy_us) / 1e3, 1),
        "gpu_idle_gaps": gap_histogram(timeline.gaps_us),
        "largest_gpu_gaps_ms": [round(g / 1e3, 2) for g in sorted(timeline.gaps_us, reverse=True)[:5]],
        "step_kinds": step_kinds(intervals),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval before start")
    ap.add_argument("--lag-trace", action="store_true", help="sample thread stacks while the loop stalls")
    ap.add_argument("--gpu-profile", action="store_true", help="the GPU's busy time and idle gaps (CUDA only)")
    ap.add_argument("--host-timing", action="store_true", help="the step thread's time per step, by phase")
    ap.add_argument("--replicas", type=int, default=None, help="a ReplicaPool of N engines on Ray (needs Ray)")
    add_engine_arg_option(ap)
    args = ap.parse_args()
    if args.replicas and (args.gpu_profile or args.host_timing):
        ap.error("--gpu-profile and --host-timing see this process only: not with --replicas")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    print(json.dumps(asyncio.run(run(args, engine_kwargs(args.engine_arg)))), flush=True)


if __name__ == "__main__":
    main()
