"""2,000 concurrent HTTP clients against a real uvicorn server on the tiny checkpoint (issue 22): readers
that read everything, slow readers, clients that disconnect at random points (before the answer, after the
headers, mid-stream; some with a reset), streamed and not. Afterwards every block is free, no request is
left live, and memory is flat.

Memory, measured honestly: a first round of 2,000 clients warms every cache and pool (allocator arenas,
uvicorn's and the engine's buffers, token strings); then, around a second round like it, the objects the
garbage collector tracks are counted and the process's resident memory is read. Python state leaked per
request shows in the count: every request has its own stream, slot, accumulator and response generator,
so a leak of any of them is 2,000 objects or more (keeping each request's `Submission` alive reads
+24,000); the count moves by under 150 otherwise. Memory outside Python objects (buffers, tensors, socket
state) shows in the resident size: it moves by 3-6 MiB; the bound below is four times that. (tracemalloc
would see more, but slows the round tenfold and its own tables move the resident size by 70 MiB.)
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.server.serving import RunningServer, start_server

pytestmark = pytest.mark.slow  # starts processes or servers: seconds each

NUM_CLIENTS = 2000
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=16, num_kv_blocks=2048, max_model_len=256, max_num_seqs=256
)
MAX_OBJECTS_GROWTH = NUM_CLIENTS // 4  # a leak of one object per request would be 2,000
MAX_RSS_GROWTH_MIB = 24.0  # 12 KiB per request: a leaked response body or output buffer


@pytest.fixture(scope="module")
def crowd(tiny_model: Path) -> Iterator[tuple[AsyncLLMEngine, RunningServer]]:
    engine = AsyncLLMEngine(str(tiny_model), **ENGINE_ARGS)
    running = start_server(create_app(engine, served_model_name="tiny"))
    yield engine, running
    running.stop()
    engine.shutdown()


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _client(port: int, rng: random.Random, outcome: dict[str, int]) -> None:
    """One client: what it asks and how it reads (or leaves) are drawn from `rng`."""
    stream = rng.random() < 0.75
    body = {
        "model": "tiny",
        "prompt": [rng.randrange(1, 300) for _ in range(rng.randrange(2, 12))],
        "max_tokens": rng.randrange(1, 10),
        "ignore_eos": True,
        "stream": stream,
    }
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    ).encode()
    kinds = ["read", "read", "slow", "half_sent", "leave_early", "leave_after_head", "leave_mid", "reset"]
    behaviour = rng.choice(kinds)
    leave_at = rng.randrange(1, 400)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if behaviour == "half_sent":  # gone before the request was whole
            writer.write((head + payload)[: rng.randrange(1, len(head) + len(payload))])
            await writer.drain()
            outcome["left"] += 1
            return
        writer.write(head + payload)
        await writer.drain()
        if behaviour == "leave_early":
            await asyncio.sleep(rng.random() * 0.05)
            outcome["left"] += 1
            return
        received = b""
        while True:
            if behaviour == "slow":
                await asyncio.sleep(rng.random() * 0.02)
                chunk = await reader.read(64)
            else:
                chunk = await reader.read(65536)
            if not chunk:
                break
            received += chunk
            in_body = b"\r\n\r\n" in received
            if behaviour == "leave_after_head" and in_body:
                outcome["left"] += 1
                return
            if behaviour in ("leave_mid", "reset") and in_body and len(received) > leave_at:
                if behaviour == "reset":
                    writer.transport.abort()  # RST, not FIN
                outcome["left"] += 1
                return
        status = int(received.split(b" ", 2)[1])
        assert status == 200, received[:500]
        if stream:  # chunked: the last chunk's data is [DONE], then the empty chunk
            assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), received[-300:]
        else:
            assert b'"finish_reason":"length"' in received, received[-300:]
        outcome["read"] += 1
    finally:
        writer.close()


async def _round(port: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcome = {"read": 0, "left": 0}
    clients = [_client(port, random.Random(rng.random()), outcome) for _ in range(NUM_CLIENTS)]
    await asyncio.wait_for(asyncio.gather(*clients), 120)
    assert sum(outcome.values()) == NUM_CLIENTS
    return outcome


async def _drained(crowd: tuple[AsyncLLMEngine, RunningServer], timeout: float = 10.0) -> dict[str, float | int]:
    """The engine idle with every block free, and the server with no connection or handler left: objects are
    counted only then (regression: on a loaded machine, connections the clients had left were still being
    torn down in the server's thread when the count was taken, and read as 1,886 leaked objects)."""
    engine, running = crowd
    state = running.server.server_state
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = engine.num_live_requests == 0 and stats["num_running"] == stats["num_waiting"] == 0
        if idle and stats["num_free_blocks"] == stats["num_total_blocks"] and not state.connections and not state.tasks:
            return stats
        assert time.monotonic() < deadline, (stats, engine.num_live_requests, len(state.connections), len(state.tasks))
        await asyncio.sleep(0.01)


async def test_2000_clients_leave_every_block_free_and_memory_flat(
    crowd: tuple[AsyncLLMEngine, RunningServer],
) -> None:
    engine, running = crowd
    warm = await _round(running.port, seed=1)
    await _drained(crowd)
    gc.collect()
    objects, rss = len(gc.get_objects()), _rss_mib()
    t0 = time.monotonic()
    measured = await _round(running.port, seed=2)
    elapsed = time.monotonic() - t0
    stats = await _drained(crowd)
    gc.collect()
    grown_objects, grown_rss = len(gc.get_objects()) - objects, _rss_mib() - rss
    print(f"\n2,000 clients in {elapsed:.1f} s; {measured}; objects {grown_objects:+d}, RSS {grown_rss:+.1f} MiB")
    assert warm["left"] > 300 and measured["read"] > 600  # both kinds happened, in numbers
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and engine.num_event_loops == 0
    assert grown_objects < MAX_OBJECTS_GROWTH, grown_objects
    assert grown_rss < MAX_RSS_GROWTH_MIB, grown_rss
