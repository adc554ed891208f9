"""The server at the engine's speed? The same streamed greedy completions through `asyncllm serve` (a
subprocess, driven by several client processes: `sse_clients.py`) and on an in-process `AsyncLLMEngine`,
in one call, at each number of streams. Prints one JSON line per run and a table: output tok/s, TTFT and
ITL (the gap between events carrying text, vLLM's definition) p50/p99, tokens per event, the server's CPU
time per token, the busiest client process's CPU share (well under 1: the clients are not the bottleneck),
and the server's ratios to the engine.

    python bench/serve_load.py [--model DIR | --shape qwen3-0.6b | --paced-ms 1.3] [--device cuda]
        [--streams 64 256] [--client-procs 4 8] [--requests-per-stream 4] [--max-tokens 128]
        [--engine-arg NAME=VALUE ...] [--server-flags=--no-core-process] [--mode both|server|engine]
        [--repeat 1] [--threads 1] [--check-text] [--py-spy DIR]

Default model: the tests' tiny Qwen3 checkpoint, built now (CPU). `--shape` gives a real shape with random
weights and the real tokenizer. `--paced-ms MS` replaces the model with `paced_core.py` (a real engine core,
the Qwen3 tokenizer, steps of MS milliseconds plus `--paced-us-per-seq` per sequence, as a device takes
them): on a CPU box this leaves only the host's work, the part this benchmark is about. Every request
generates exactly `--max-tokens` tokens (`ignore_eos`) from a prompt of 8-32 random ids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # bench.shapes, tests.fixtures; sse_clients, paced_core

from engine_args import add_engine_arg_option, engine_kwargs  # noqa: E402
from sse_clients import Record, request_bytes, run_clients  # noqa: E402

from asyncllm import AsyncLLMEngine, SamplingParams  # noqa: E402


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(n)]


def pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(records: list[list[Record]], span: float, max_tokens: int) -> dict[str, Any]:
    flat = [r for per_conn in records for r in per_conn]
    ttft = [times[0] - sent for sent, times, _ in flat if times]
    itl = [b - a for _, times, _ in flat for a, b in itertools.pairwise(times)]
    events = sum(len(times) for _, times, _ in flat)
    tokens = len(flat) * max_tokens
    ms = 1e3
    return {
        "requests": len(flat),
        "tok_per_s": round(tokens / span, 1),
        "ttft_ms_p50": round(pct(ttft, 50) * ms, 2),
        "ttft_ms_p99": round(pct(ttft, 99) * ms, 2),
        "itl_ms_p50": round(pct(itl, 50) * ms, 3),
        "itl_ms_p99": round(pct(itl, 99) * ms, 3),
        "tokens_per_event": round(tokens / max(events, 1), 2),
        "seconds": round(span, 3),
    }


# ---------------------------------------------------------------- the server, as a subprocess
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The server's child processes (the engine core process, TP workers)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def thread_seconds(pid: int) -> list[float]:
    """Each thread's CPU seconds, busiest first."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return sorted(out, reverse=True)


def engine_flags(engine_args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        out += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else [flag, str(value)]
    return out


def start_server(model: str | None, engine_args: dict[str, Any], args: argparse.Namespace) -> tuple[Any, int]:
    port = free_port()
    if args.paced_ms is not None:
        cmd = [sys.executable, str(Path(__file__)), "--serve-paced", str(port), "--paced-ms", str(args.paced_ms)]
        cmd += ["--paced-us-per-seq", str(args.paced_us_per_seq)]
        cmd += [f"--server-flags={args.server_flags}"]  # read by serve_paced
    else:
        cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(model), "--port", str(port)]
        cmd += ["--served-model-name", "bench", "--log-level", "warning", *engine_flags(engine_args)]
        cmd += shlex.split(args.server_flags)
    proc = subprocess.Popen(cmd)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during start-up: {cmd}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.2)


def run_server(model: str | None, engine_args: dict[str, Any], args: argparse.Namespace) -> dict[int, Any]:
    proc, port = start_server(model, engine_args, args)
    out: dict[int, Any] = {}
    try:
        for streams, procs in zip(args.streams, args.client_procs):
            body = dict(model="bench", max_tokens=args.max_tokens, temperature=0, stream=True, ignore_eos=True)
            warm = [request_bytes(port, {**body, "prompt": p}) for p in prompts(streams, args.vocab, 1)]
            rounds = []
            for rnd in range(args.repeat):
                work = [[request_bytes(port, {**body, "prompt": p}) for p in ps] for ps in workload(args, streams)]
                spy = _py_spy(proc.pid, args, f"server-{streams}-{rnd}")
                children = child_pids(proc.pid)
                cpu0, threads0 = cpu_seconds(proc.pid), thread_seconds(proc.pid)
                child0 = sum(cpu_seconds(c) for c in children)
                records, reports = run_clients(port, work, warm, procs, args.check_text)
                cpu, threads = cpu_seconds(proc.pid) - cpu0, thread_seconds(proc.pid)
                child = sum(cpu_seconds(c) for c in children) - child0
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(60)
                span = max(r["end"] for r in reports) - min(r["start"] for r in reports)
                row = summarize(records, span, args.max_tokens)
                tokens = (row["requests"] + streams) * args.max_tokens  # the warm-up's too: its CPU time is in
                row["server_cpu_us_per_token"] = round((cpu + child) / tokens * 1e6, 1)  # the core process's too
                row["front_cpu_us_per_token"] = round(cpu / tokens * 1e6, 1)
                row["server_busiest_threads_s"] = [round(b - a, 2) for a, b in zip(threads0, threads)][:3]
                row["client_cpu_max"] = round(max(r["cpu_s"] / (r["end"] - r["start"]) for r in reports), 3)
                row["client_procs"] = procs
                rounds.append((row, texts_of(records)))
            out[streams] = median_round(rounds)
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def _py_spy(pid: int, args: argparse.Namespace, name: str) -> Any:
    if not args.py_spy:
        return None
    Path(args.py_spy).mkdir(parents=True, exist_ok=True)
    out = Path(args.py_spy) / f"{name}.txt"
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    cmd = [spy, "record", "-p", str(pid), "-o", str(out), "--format", "raw", "-r", "250", "--threads", "--gil"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def serve_paced(port: int, args: argparse.Namespace) -> None:
    """The server with the paced core (`--paced-ms`), as `asyncllm serve` runs it: uvicorn, uvloop."""
    import uvicorn
    from paced_core import paced_built

    from asyncllm.server import create_app
    from bench.shapes import find_qwen3_tokenizer

    build = functools.partial(paced_built, str(find_qwen3_tokenizer()), args.paced_ms, args.paced_us_per_seq)
    # As `asyncllm serve` chooses: the core in a process of its own unless --no-core-process.
    engine = make_paced_engine(build, "--no-core-process" not in shlex.split(args.server_flags))
    config = uvicorn.Config(create_app(engine, served_model_name="bench"), port=port, log_level="warning", loop="auto")
    try:
        uvicorn.Server(config).run()
    finally:
        engine.shutdown()


def make_paced_engine(build: Any, core_process: bool) -> AsyncLLMEngine:
    if not core_process:
        return AsyncLLMEngine.from_builder(build)
    from asyncllm.async_engine.proc_client import ProcClient

    return AsyncLLMEngine.from_client(functools.partial(ProcClient, build))


# ---------------------------------------------------------------- the engine, in this process
async def drive_engine(engine: AsyncLLMEngine, work: list[list[list[int]]], warm: list[list[int]], args: Any) -> Any:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)

    async def one(prompt: list[int]) -> Record:
        sent, times, parts = time.monotonic(), [], []
        async for chunk in engine.stream(prompt, params):
            if chunk.text:
                times.append(time.monotonic())
                parts.append(chunk.text)
        return sent, times, "".join(parts) if args.check_text else None

    await asyncio.gather(*(one(p) for p in warm))
    cpu0, start = time.process_time(), time.monotonic()

    async def serial(chunk: list[list[int]]) -> list[Record]:
        return [await one(p) for p in chunk]

    records = await asyncio.gather(*(serial(chunk) for chunk in work))
    return records, time.monotonic() - start, time.process_time() - cpu0


def run_engine(model: str | None, engine_args: dict[str, Any], args: argparse.Namespace) -> dict[int, Any]:
    if args.paced_ms is not None:
        from paced_core import paced_built

        from bench.shapes import find_qwen3_tokenizer

        build = functools.partial(paced_built, str(find_qwen3_tokenizer()), args.paced_ms, args.paced_us_per_seq)
        engine = make_paced_engine(build, False)
    else:
        engine = AsyncLLMEngine(str(model), **engine_args)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    out: dict[int, Any] = {}
    try:
        for streams in args.streams:
            rounds = []
            for _ in range(args.repeat):
                warm = prompts(streams, args.vocab, 1)
                records, span, cpu = runner(drive_engine(engine, workload(args, streams), warm, args))
                row = summarize(records, span, args.max_tokens)
                row["process_cpu_us_per_token"] = round(cpu / (row["requests"] * args.max_tokens) * 1e6, 1)
                rounds.append((row, texts_of(records)))
            out[streams] = median_round(rounds)
    finally:
        engine.shutdown()
    return out


# ---------------------------------------------------------------- both, and the table
def workload(args: argparse.Namespace, streams: int) -> list[list[list[int]]]:
    """Stream i's prompts, sent one after another: the same in every mode."""
    batch = prompts(streams * args.requests_per_stream, args.vocab, 0)
    return [batch[i::streams] for i in range(streams)]


def texts_of(records: list[list[Record]]) -> list[str | None]:
    return [text for per_conn in records for _, _, text in per_conn]


def median_round(rounds: list[tuple[dict[str, Any], list[str | None]]]) -> tuple[dict[str, Any], list[str | None]]:
    return sorted(rounds, key=lambda r: r[0]["tok_per_s"])[len(rounds) // 2]


def resolve_model(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    if args.paced_ms is not None:
        args.vocab = 151_000
        return None, {}
    on_cpu = args.device == "cpu"
    base: dict[str, Any] = dict(device=args.device)
    if on_cpu:
        base |= dict(num_kv_blocks=4096, block_size=16, max_model_len=512)
    else:
        base |= dict(max_model_len=1024)
    if args.model:
        return args.model, base
    if args.shape:
        from bench.shapes import SHAPES, write_shape_dir

        args.vocab = SHAPES[args.shape]["vocab_size"]
        path = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
        return str(path), base | {"load_format": "dummy"}
    from tests.fixtures.tiny_models import build_checkpoint

    return str(build_checkpoint(Path(tempfile.mkdtemp()) / "qwen3", "qwen3")), base


def table(results: dict[str, dict[int, Any]], args: argparse.Namespace) -> None:
    cols = ("tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tokens_per_event")
    print("| streams | mode | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | tok/event | CPU us/tok | client CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for streams in args.streams:
        for mode in ("server", "engine"):
            if streams not in results.get(mode, {}):
                continue
            r = results[mode][streams][0]
            cpu = r.get("server_cpu_us_per_token", r.get("process_cpu_us_per_token"))
            print(
                f"| {streams} | {mode} | {r['tok_per_s']:,.0f} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} | "
                f"{r['itl_ms_p50']} / {r['itl_ms_p99']} | {r['tokens_per_event']} | {cpu} | "
                f"{r.get('client_cpu_max', '-')} |"
            )
        if streams in results.get("server", {}) and streams in results.get("engine", {}):
            s, e = results["server"][streams][0], results["engine"][streams][0]
            ratio = {c: round(s[c] / e[c], 3) if e[c] else None for c in cols[:5]}
            same = results["server"][streams][1] == results["engine"][streams][1] if args.check_text else None
            line = {"bench": "serve_load", "streams": streams, "server_flags": args.server_flags, "ratio": ratio}
            print(json.dumps({**line, "identical_text": same}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tests' tiny Qwen3, built now)")
    ap.add_argument("--shape", default=None, help="a bench/shapes.py shape with random weights, e.g. qwen3-0.6b")
    ap.add_argument("--paced-ms", type=float, default=None, help="no model: paced_core.py, a step's fixed ms (1.3)")
    ap.add_argument("--paced-us-per-seq", type=float, default=17.0, help="with --paced-ms: a step's us per sequence")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--client-procs", type=int, nargs="+", default=[4, 8], help="one per --streams value (or one)")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=300, help="prompt ids are drawn below this (set by --shape)")
    ap.add_argument(
        "--server-flags",
        default="",
        help="more serve flags, one string: --server-flags=--no-core-process (the step thread)",
    )
    ap.add_argument("--mode", choices=("both", "server", "engine"), default="both")
    ap.add_argument("--repeat", type=int, default=1, help="timed rounds per setting; the median one is reported")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both engines (CPU)")
    ap.add_argument("--check-text", action="store_true", help="keep every text; the ratio line compares them")
    ap.add_argument("--py-spy", default=None, metavar="DIR", help="py-spy record the server's timed rounds here")
    ap.add_argument("--serve-paced", type=int, default=None, help=argparse.SUPPRESS)  # the paced server's port
    add_engine_arg_option(ap)
    args = ap.parse_args()
    if args.serve_paced is not None:
        serve_paced(args.serve_paced, args)
        return
    if len(args.client_procs) == 1:
        args.client_procs = args.client_procs * len(args.streams)
    if len(args.client_procs) != len(args.streams):
        raise SystemExit("--client-procs takes one value, or one per --streams value")
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads (checkpoint, engine)
    model, engine_args = resolve_model(args)
    engine_args |= engine_kwargs(args.engine_arg)
    results: dict[str, dict[int, Any]] = {}
    if args.mode in ("both", "server"):
        results["server"] = run_server(model, engine_args, args)
    if args.mode in ("both", "engine"):
        results["engine"] = run_engine(model, engine_args, args)
    name = "paced" if args.paced_ms is not None else args.shape or args.model or "tiny-qwen3"
    common = {"bench": "serve_load", "model": name, "device": args.device, "max_tokens": args.max_tokens}
    for mode, per_streams in results.items():
        for streams, (row, _) in per_streams.items():
            print(json.dumps({**common, "mode": mode, "streams": streams, "server_flags": args.server_flags, **row}))
    table(results, args)


if __name__ == "__main__":
    main()
