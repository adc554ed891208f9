"""Can hostile clients hold up honest ones? (issue 39) `asyncllm serve` on the tests' tiny Qwen3 checkpoint
(CPU), N honest streamed completions (`sse_clients.py`'s client processes), measured alone, then beside M
hostile clients, then alone again. The honest streams' inter-token latency p99 with the hostile clients must
stay within 1.5x of the same streams alone (the mean of the two alone runs).

Hostile clients, in one process of their own, each repeating one kind every `--hostile-interval` seconds:
`oversized` (a chat message of `--oversized-mb` MB), `deep` (a body nested 5,000 levels), `surrogate` (a
lone surrogate in a chat message), `trickle` (headers one byte at a time until the server closes the
connection), `stall` (a head and half a body, then nothing, until the server closes it); with
`--kinds ... compile` also a 20,000-string enum that compiles for seconds once, then is served from the
compile cache: each request's mask fills are slow (3-10 ms a row at its widest states), and go to the slow
lane (structured_output/slow_lane.py); `schema`, the control: a schema as large and with as many strings (the
same 20,000 under `examples`, which constrains nothing) that is cheap to follow (an enum of three values), so
what reading such a body costs shows apart from what the enum's masks cost. Every answer is counted by
status (a 5xx would be a bug); a connection the server closed counts as "closed". The hostile clients start
together and each sends once a `--hostile-interval`, so their requests come in bursts (the harder case);
`--hostile-spread` starts each at a random point of its first interval.

    python bench/hostile_clients.py [--honest 100] [--hostile 100] [--max-tokens 64] [--requests-per-stream 2]
        [--client-procs 2] [--kinds oversized deep surrogate trickle stall] [--hostile-spread] [--server-flags=...]

Runs alternate (alone, hostile, ... alone: `--rounds` of each, one more alone) so that the machine's other load
falls on both alike. Prints one JSON line per run and one summary line: the median of the honest ITL p99s alone
and beside the hostile clients, their ratio, the 1.5x limit and the percent of it used, and the answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # tests.fixtures; serve_load, sse_clients

from serve_load import free_port, prompts, summarize  # noqa: E402
from sse_clients import request_bytes, run_clients  # noqa: E402

LIMIT = 1.5  # the bound: honest ITL p99 beside hostile clients <= 1.5x alone
_PIECE = 1 << 16  # a hostile body is written in pieces of this many bytes, each when the last was taken
MODEL = "bench"


# ---------------------------------------------------------------- hostile requests, pre-encoded
def post(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def chat(content: bytes) -> bytes:
    return b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "%s"}]}' % (
        MODEL.encode(),
        content,
    )


def hostile_requests(oversized_mb: float) -> dict[str, bytes]:
    depth = 5_000  # past json.loads' recursion (~1,000): a body the server must refuse without parsing it
    deep = b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * depth + b"]" * depth + b"}"
    enum = json.dumps({"enum": [f"{i:05d}" for i in range(20_000)]}).encode()
    large = json.dumps({"enum": ["a", "b", "c"], "examples": [f"{i:05d}" for i in range(20_000)]}).encode()
    return {
        "oversized": post("/v1/chat/completions", chat(b"b " * int(oversized_mb * 2**19))),
        "deep": post("/v1/completions", deep),
        "surrogate": post("/v1/chat/completions", chat(b"a\\ud800b")),
        "compile": post("/v1/chat/completions", _constrained_chat(enum)),
        "schema": post("/v1/chat/completions", _constrained_chat(large)),
        "trickle": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
        "stall": post("/v1/completions", b'{"model": "%s", "prompt": "Hi", "max_tokens": 4}' % MODEL.encode())[:-20],
    }


def _constrained_chat(schema: bytes) -> bytes:
    return (
        b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], ' % (MODEL.encode())
        + b'"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": %s}}}' % schema
    )


async def _status(reader: asyncio.StreamReader) -> str:
    """The answer's status code, or "closed" when the server closed the connection without one."""
    line = await reader.readline()
    if not line:
        return "closed"
    status = line.split(b" ", 2)[1].decode()
    length = 0
    while (header := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


async def hostile_client(
    port: int, kind: str, request: bytes, interval: float, until: list[float], counts: Counter, offset: float = 0.0
) -> None:
    """One client repeating `kind` every `interval` seconds until `until[0]` (monotonic; moved when told), the
    first time after `offset` seconds."""
    await asyncio.sleep(offset)
    while time.monotonic() < until[0]:
        started = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            counts[f"{kind}:refused"] += 1
            await asyncio.sleep(interval)
            continue
        try:
            if kind == "trickle":  # a byte at a time, never a whole head, until the server gives up on it
                writer.write(request)
                while time.monotonic() < until[0] and not reader.at_eof():
                    writer.write(b"x")
                    await writer.drain()
                    try:
                        await asyncio.wait_for(reader.read(1 << 16), 0.2)
                    except asyncio.TimeoutError:
                        continue
                    break
                counts[f"{kind}:{'closed' if reader.at_eof() else 'open at the end'}"] += 1
            else:
                answer = asyncio.ensure_future(_status(reader))
                view = memoryview(request)
                with contextlib.suppress(ConnectionError):  # a refusal may close the connection mid-upload
                    for start in range(0, len(view), _PIECE):  # as the server reads it: a refusal stops it
                        if answer.done():
                            break
                        writer.write(view[start : start + _PIECE])
                        await writer.drain()
                while not answer.done() and time.monotonic() < until[0]:
                    await asyncio.wait([answer], timeout=0.1)
                if answer.done():
                    counts[f"{kind}:{answer.result()}"] += 1
                else:
                    answer.cancel()
                    counts[f"{kind}:open at the end"] += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            counts[f"{kind}:closed"] += 1
        finally:
            writer.close()
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


def _hostile_main(port: int, args: argparse.Namespace, stop: Any, conn: Any) -> None:
    """The hostile clients' process: `args.hostile` clients, kinds in turn, until `stop` (an mp.Event) is set
    (or `args.hostile_seconds` passed); sends the answers' counts on `conn`."""
    requests = hostile_requests(args.oversized_mb)
    counts: Counter = Counter()
    until = [time.monotonic() + args.hostile_seconds]

    async def watch() -> None:
        while not stop.is_set() and time.monotonic() < until[0]:
            await asyncio.sleep(0.05)
        until[0] = time.monotonic()

    async def run() -> None:
        chosen = [args.kinds[i % len(args.kinds)] for i in range(args.hostile)]
        interval = args.hostile_interval
        rng = random.Random(0)
        offsets = [rng.uniform(0, interval) if args.hostile_spread else 0.0 for _ in chosen]
        clients = (hostile_client(port, k, requests[k], interval, until, counts, o) for k, o in zip(chosen, offsets))
        await asyncio.gather(watch(), *clients)

    try:
        asyncio.run(run())
    finally:
        conn.send(dict(counts))


# ---------------------------------------------------------------- the runs
def start_server(model: str, flags: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    import urllib.request

    port = free_port()
    cmd = [sys.executable, "-m", "asyncllm.cli", "serve", model, "--port", str(port), "--served-model-name", MODEL]
    cmd += ["--log-level", "warning", "--device", "cpu", "--num-kv-blocks", "4096", "--block-size", "16"]
    cmd += ["--max-model-len", "512", *flags]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during start-up: {cmd}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not start")


def honest_run(port: int, args: argparse.Namespace, hostile: bool) -> dict[str, Any]:
    body = dict(model=MODEL, max_tokens=args.max_tokens, temperature=0, stream=True, ignore_eos=True)
    warm = [request_bytes(port, {**body, "prompt": p}) for p in prompts(args.honest, 300, 1)]
    batch = prompts(args.honest * args.requests_per_stream, 300, 0)
    work = [[request_bytes(port, {**body, "prompt": p}) for p in batch[i :: args.honest]] for i in range(args.honest)]
    ctx = mp.get_context("spawn")
    stop, (parent, child_conn) = ctx.Event(), ctx.Pipe(duplex=False)
    child = None
    if hostile:
        child = ctx.Process(target=_hostile_main, args=(port, args, stop, child_conn), daemon=True)
        child.start()
        time.sleep(args.hostile_warmup)  # the hostile clients are at it before the honest ones start
    records, reports = run_clients(port, work, warm, args.client_procs, False)
    span = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    row = summarize(records, span, args.max_tokens)
    if child is not None:
        stop.set()
        if not parent.poll(60):  # it sends its counts even when it fails
            raise RuntimeError("the hostile clients' process did not report")
        row["hostile_answers"] = parent.recv()
        child.join(30)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tests' tiny Qwen3, built now)")
    ap.add_argument("--honest", type=int, default=100, help="honest streams, each running --requests-per-stream")
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--hostile", type=int, default=100)
    kinds = ["oversized", "deep", "surrogate", "trickle", "stall", "compile", "schema"]
    ap.add_argument("--kinds", nargs="+", choices=kinds, default=kinds[:5])
    ap.add_argument("--oversized-mb", type=float, default=10.0)
    ap.add_argument("--hostile-interval", type=float, default=1.0, help="seconds between one client's requests")
    ap.add_argument("--hostile-spread", action="store_true", help="start each hostile client at a random point")
    ap.add_argument("--hostile-seconds", type=float, default=600.0, help="the most they run (they stop with the run)")
    ap.add_argument("--rounds", type=int, default=3, help="alone and hostile runs, alternating (and one more alone)")
    ap.add_argument("--hostile-warmup", type=float, default=2.0)
    ap.add_argument("--server-flags", default="", help="more serve flags, one string")
    args = ap.parse_args()
    if args.model is None:
        from tests.fixtures.tiny_models import build_checkpoint

        args.model = str(build_checkpoint(Path(tempfile.mkdtemp()) / "qwen3", "qwen3"))
    proc, port = start_server(args.model, shlex.split(args.server_flags))
    runs: list[tuple[str, dict[str, Any]]] = []
    try:
        for _ in range(args.rounds):  # alternating, so that the machine's other load falls on both alike
            runs.append(("alone", honest_run(port, args, hostile=False)))
            runs.append(("hostile", honest_run(port, args, hostile=True)))
        runs.append(("alone", honest_run(port, args, hostile=False)))
    finally:
        proc.terminate()
        proc.wait(60)
    common = {"bench": "hostile_clients", "honest": args.honest, "hostile": args.hostile, "kinds": args.kinds}
    for name, row in runs:
        print(json.dumps({**common, "run": name, **row}))
    alone = statistics.median(row["itl_ms_p99"] for name, row in runs if name == "alone")
    beside = statistics.median(row["itl_ms_p99"] for name, row in runs if name == "hostile")
    answers: Counter = Counter()
    for _, row in runs:
        answers.update(row.get("hostile_answers", {}))
    ratio = beside / alone
    # Each hostile run against the alone runs on either side of it: the machine's other load drifts less
    # within a round than across the whole benchmark.
    p99 = [row["itl_ms_p99"] for _, row in runs]
    per_round = [p99[i] / ((p99[i - 1] + p99[i + 1]) / 2) for i in range(1, len(runs) - 1, 2)]
    summary = {
        "bench": "hostile_clients",
        "itl_ms_p99_alone_median": alone,
        "itl_ms_p99_hostile_median": beside,
        "ratio": round(ratio, 3),
        "ratio_per_round": [round(r, 3) for r in per_round],
        "ratio_per_round_median": round(statistics.median(per_round), 3),
        "limit": LIMIT,
        "percent_of_limit": round(100 * ratio / LIMIT, 1),
        "hostile_answers": dict(answers),
        "server_errors": {k: v for k, v in answers.items() if k.split(":")[1].startswith("5")},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
