"""What the HTTP server costs: the same streamed greedy requests through `asyncllm serve` (a subprocess, read
with the official AsyncOpenAI client) and directly on an in-process `AsyncLLMEngine`, at one concurrency.

Prints one JSON line per mode (throughput, TTFT, ITL = gap between streamed chunks as vLLM's benchmark
defines it, TPOT = a request's mean time per output token; p50/p99) and one line with the ratios. Default
model: the tests' tiny Qwen3 checkpoint, built into a temp dir (CPU).

python bench/serve_overhead.py [--model DIR | --shape qwen3-0.6b] [--concurrency 64] [--num-requests 256]
                               [--max-tokens 64] [--device cpu] [--num-kv-blocks 2048] [--repeat 3]
                               [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.shapes, tests.fixtures

from asyncllm import AsyncLLMEngine, SamplingParams

Chunks = Callable[[list[int]], AsyncIterator[str]]  # prompt -> the texts of its streamed chunks (non-empty)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Seed 1 warms up, seed 0 is timed: fresh prompts, no prefix-cache hits from the warm-up."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(n)]


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def drive(chunks: Chunks, batch: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    texts: list[str] = [""] * len(batch)
    num_chunks = 0

    async def one(i: int) -> None:
        nonlocal num_chunks
        async with gate:
            start = first = last = time.perf_counter()
            parts: list[str] = []
            async for text in chunks(batch[i]):
                now = time.perf_counter()
                if parts:
                    itl.append(now - last)
                else:
                    first = now
                    ttft.append(now - start)
                parts.append(text)
                last = now
            num_chunks += len(parts)
            tpot.append((last - first) / (max_tokens - 1))
            texts[i] = "".join(parts)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(batch))))
    seconds = time.perf_counter() - t0
    tokens = len(batch) * max_tokens  # ignore_eos: every request generates exactly max_tokens
    ms = 1e3
    return {
        "requests": len(batch),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1),
        "ttft_ms_p50": round(pct(ttft, 50) * ms, 2),
        "ttft_ms_p99": round(pct(ttft, 99) * ms, 2),
        "itl_ms_p50": round(pct(itl, 50) * ms, 2),
        "itl_ms_p99": round(pct(itl, 99) * ms, 2),
        "tpot_ms_p50": round(pct(tpot, 50) * ms, 2),
        "tpot_ms_p99": round(pct(tpot, 99) * ms, 2),
        "tokens_per_chunk": round(tokens / num_chunks, 2),
        "_texts": texts,
    }


async def run_engine(model: str, engine_args: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    async with AsyncLLMEngine(model, **engine_args) as engine:

        async def chunks(prompt: list[int]) -> AsyncIterator[str]:
            async for chunk in engine.stream(prompt, params):
                if chunk.text:  # as the server sends: chunks whose text is held back send nothing
                    yield chunk.text

        return await timed(chunks, args)


async def timed(chunks: Chunks, args: argparse.Namespace, server_pid: int | None = None) -> dict[str, Any]:
    """A warm-up round, then `--repeat` timed rounds of the same prompts; the round of median throughput,
    with the CPU seconds this process (and the server's, if any) spent on it."""
    await drive(chunks, prompts(args.concurrency, args.vocab, 1), args.concurrency, args.max_tokens)
    runs = []
    for _ in range(args.repeat):
        cpu0, server0 = time.process_time(), _cpu_seconds(server_pid)
        run = await drive(chunks, prompts(args.num_requests, args.vocab, 0), args.concurrency, args.max_tokens)
        run["bench_process_cpu_s"] = round(time.process_time() - cpu0, 2)
        if server_pid is not None:
            run["server_process_cpu_s"] = round(_cpu_seconds(server_pid) - server0, 2)
        runs.append(run)
    return sorted(runs, key=lambda r: r["tok_per_s"])[len(runs) // 2]


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process, all threads (Linux /proc; 0 elsewhere)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _flags(engine_args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        out += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else [flag, str(value)]
    return out


async def run_server(model: str, engine_args: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from openai import AsyncOpenAI

    from tests.server.serving import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "asyncllm.cli", "serve", model, "--port", str(port), "--served-model-name", "bench"]
    env = dict(os.environ) if args.threads is None else {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen([*cmd, "--log-level", "warning", *_flags(engine_args)], env=env)
    try:
        async with httpx.AsyncClient() as http:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("the server exited during startup")
                try:
                    if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.2)
        base_url = f"http://127.0.0.1:{port}/v1"
        body = dict(model="bench", max_tokens=args.max_tokens, temperature=0, stream=True)
        async with AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0) as client:

            async def chunks(prompt: list[int]) -> AsyncIterator[str]:
                stream = await client.completions.create(prompt=prompt, **body, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        yield chunk.choices[0].text

            return await timed(chunks, args, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def resolve_model(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if args.model:
        return args.model, {}
    if args.shape:
        from bench.shapes import SHAPES, write_shape_dir

        args.vocab = SHAPES[args.shape]["vocab_size"]
        return str(write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)), {"load_format": "dummy"}
    from tests.fixtures.tiny_models import build_checkpoint

    return str(build_checkpoint(Path(tempfile.mkdtemp()) / "qwen3", "qwen3")), {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tests' tiny Qwen3, built now)")
    ap.add_argument("--shape", default=None, help="a bench/shapes.py shape with random weights, e.g. qwen3-0.6b")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=300, help="prompt ids are drawn below this (set by --shape)")
    ap.add_argument("--repeat", type=int, default=1, help="timed rounds per mode; the median one is reported")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of the engine in both modes (OMP_NUM_THREADS); on a small CPU box spinning OpenMP "
        "threads fight the client for cores, 1 gives stable figures",
    )
    args = ap.parse_args()
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported here (checkpoint, engine)
    model, extra = resolve_model(args)
    engine_args = dict(device=args.device, num_kv_blocks=args.num_kv_blocks, block_size=16, max_model_len=512, **extra)
    results = {
        "server": asyncio.run(run_server(model, engine_args, args)),
        "engine": asyncio.run(run_engine(model, engine_args, args)),
    }
    texts = {mode: r.pop("_texts") for mode, r in results.items()}
    model_name = args.shape or args.model or "tiny-qwen3"
    common = {"bench": "serve_overhead", "device": args.device, "model": model_name, "threads": args.threads}
    for mode, result in results.items():
        print(json.dumps({**common, "mode": mode, "concurrency": args.concurrency, **result}))
    server, engine = results["server"], results["engine"]
    ratio = {
        "throughput_ratio": round(server["tok_per_s"] / engine["tok_per_s"], 3),
        "ttft_p50_ratio": round(server["ttft_ms_p50"] / engine["ttft_ms_p50"], 3),
        "tpot_p50_ratio": round(server["tpot_ms_p50"] / engine["tpot_ms_p50"], 3),
        "identical_text": texts["server"] == texts["engine"],
    }
    print(json.dumps({**common, "mode": "ratio", **ratio}))


if __name__ == "__main__":
    main()
