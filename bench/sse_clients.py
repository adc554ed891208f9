"""Load generators for `serve_load.py`: client processes that stream completions over raw HTTP/1.1.

Each process runs one event loop (uvloop when installed) with its share of the streams, one keep-alive
connection each, written and read with asyncio streams: the request is a pre-encoded byte string, the
response's chunked framing is undone by hand, and an SSE event is only scanned for an empty `"text":""`
(no JSON parse unless texts are kept), so a client costs a few microseconds per event and many streams fit
in one process. Every process reports its own CPU time, so the table can show the clients were not the
bottleneck. Times are `time.monotonic()`: one clock for every process on the host.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamRecord:
    """One request as its client saw it: when it was sent, when each event with text arrived."""

    sent: float
    times: list[float] = field(default_factory=list)  # arrival of each event carrying text
    text: str | None = None  # the concatenated text, when kept


def request_bytes(port: int, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    status = int((await reader.readline()).split(b" ", 2)[1])
    headers: dict[bytes, bytes] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def stream_one(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, keep_text: bool
) -> StreamRecord:
    """Send one streamed completion on an open connection and read its events up to `[DONE]`."""
    record = StreamRecord(time.monotonic())
    writer.write(request)
    status, headers = await _read_head(reader)
    if status != 200 or headers.get(b"transfer-encoding") != b"chunked":
        size = int(headers.get(b"content-length", b"0"))
        body = await reader.readexactly(size) if size else b""
        raise RuntimeError(f"server answered {status}: {body[:300]!r}")
    buf = b""
    parts: list[str] = []
    times = record.times
    while True:
        size = int((await reader.readline()).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readline()  # the chunked body's last CRLF
            break
        buf += (await reader.readexactly(size + 2))[:-2]
        while (end := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:end], buf[end + 2 :]
            if event == b"data: [DONE]":
                continue
            if b'"error"' in event[:16]:
                raise RuntimeError(f"error event: {event[:300]!r}")
            if b'"text":""' not in event:
                times.append(time.monotonic())
                if keep_text:
                    parts.append(json.loads(event[6:])["choices"][0]["text"])
    if keep_text:
        record.text = "".join(parts)
    return record


async def _run(port: int, work: list[list[bytes]], warm: list[bytes], keep_text: bool, barrier: Any) -> dict:
    """`work[c]`: the requests connection c sends one after another; `warm[c]` first, before the barrier."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in work]
    await asyncio.gather(*(stream_one(r, w, warm[i], False) for i, (r, w) in enumerate(conns)))
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)  # every process starts together
    cpu0, start = time.process_time(), time.monotonic()

    async def serial(i: int) -> list[StreamRecord]:
        reader, writer = conns[i]
        return [await stream_one(reader, writer, request, keep_text) for request in work[i]]

    records = await asyncio.gather(*(serial(i) for i in range(len(work))))
    end = time.monotonic()
    cpu = time.process_time() - cpu0
    for _, writer in conns:
        writer.close()
    return {
        "start": start,
        "end": end,
        "cpu_s": cpu,
        "records": [[(r.sent, r.times, r.text) for r in per_conn] for per_conn in records],
    }


def _client_main(
    conn: Any, port: int, work: list[list[bytes]], warm: list[bytes], keep_text: bool, barrier: Any
) -> None:
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        conn.send(runner(_run(port, work, warm, keep_text, barrier)))
    except BaseException as exc:
        barrier.abort()
        conn.send({"error": repr(exc)})
        raise


Record = tuple[float, list[float], "str | None"]  # (sent, arrival of each event with text, text if kept)


def run_clients(
    port: int, work: list[list[bytes]], warm: list[bytes], procs: int, keep_text: bool
) -> tuple[list[list[Record]], list[dict]]:
    """Spread the connections over `procs` processes (spawned) and run them from one barrier. Returns each
    connection's records, in `work`'s order, and each process's `start`/`end` (monotonic) and `cpu_s`."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    shares = [list(range(i, len(work), procs)) for i in range(procs)]
    pipes, children = [], []
    for share in shares:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_client_main,
            args=(child, port, [work[c] for c in share], [warm[c] for c in share], keep_text, barrier),
            daemon=True,
        )
        proc.start()
        child.close()
        pipes.append(parent)
        children.append(proc)
    records: list[list[Record]] = [[] for _ in work]
    reports = []
    for parent, proc, share in zip(pipes, children, shares):
        report = parent.recv()
        proc.join()
        if "error" in report:
            raise RuntimeError(f"a client process failed: {report['error']}")
        for c, per_conn in zip(share, report.pop("records")):
            records[c] = per_conn
        reports.append(report)
    return records, reports
