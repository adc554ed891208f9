"""Broadcast latency of the shared-memory ring: from the start of `write()` to a reader process holding the
bytes, for messages of a decode step's size (4 KB), 64 KB and 1 MB, with 1 and 2 reader processes.

The writer stamps `time.perf_counter_ns()` (CLOCK_MONOTONIC, one clock for every process on the host) into each
message just before writing it; each reader subtracts it from its own clock once `read()` returns. The writer
waits until every reader has read a message, then `--gap-us` more, before the next (no queueing). A gap shorter
than the readers' spin (`--spin-us`) measures the hand-off to a polling reader, a longer one the wake-up of a
sleeping reader (what an engine's workers see between steps). Prints one JSON line per case with p50/p99/max in
microseconds over every reader's messages, warm-up excluded.

python bench/ring_latency.py [--messages 3000] [--sizes 4096 65536 1048576] [--readers 1 2] [--gaps-us 20 1000]
                             [--spin-us 50] [--slot-bytes 262144]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import struct
import time
from typing import Any

from asyncllm.distributed import RingClosedError, RingHandle, ShmRingReader, ShmRingWriter
from asyncllm.distributed.shm_ring import DEFAULT_SLOT_BYTES

_STAMP = struct.Struct("<Q")
_WARMUP = 200


def reader_main(handle: RingHandle, spin_s: float, results: Any) -> None:
    latencies_ns: list[int] = []
    with ShmRingReader.attach(handle, spin_s=spin_s) as reader:
        results.put("ready")
        try:
            while True:
                data = reader.read()
                latencies_ns.append(time.perf_counter_ns() - _STAMP.unpack_from(data)[0])
        except RingClosedError:
            pass
    results.put(latencies_ns[_WARMUP:])


def pause(gap_ns: int) -> None:
    """Busy-wait short gaps, which a sleep would overshoot; sleep long ones."""
    if gap_ns >= 500_000:
        time.sleep(gap_ns / 1e9)
        return
    end = time.perf_counter_ns() + gap_ns
    while time.perf_counter_ns() < end:
        pass


def run_case(
    size: int, n_readers: int, gap_us: float, spin_us: float, messages: int, slot_bytes: int
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    body = os.urandom(size - _STAMP.size)
    with ShmRingWriter(n_readers, slot_bytes=slot_bytes) as writer:
        procs = [
            ctx.Process(target=reader_main, args=(writer.reader_handle(rank), spin_us * 1e-6, results))
            for rank in range(n_readers)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:
            assert results.get(timeout=60) == "ready"
        gap_ns = int(gap_us * 1000)
        for _ in range(messages + _WARMUP):
            pause(gap_ns)
            writer.write_parts((_STAMP.pack(time.perf_counter_ns()), body))
            writer.wait_until_read()  # no queueing: each message finds the readers waiting for it
        writer.close()
        latencies = [ns / 1000 for _ in procs for ns in results.get(timeout=60)]
        for proc in procs:
            proc.join()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "bench": "ring_latency",
        "bytes": size,
        "readers": n_readers,
        "gap_us": gap_us,
        "spin_us": spin_us,
        "slot_bytes": slot_bytes,
        "messages": messages,
        "p50_us": round(q[49], 1),
        "p99_us": round(q[98], 1),
        "max_us": round(max(latencies), 1),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=3000, help="timed messages per case (after a warm-up)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20])
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gaps-us", type=float, nargs="+", default=[20.0, 1000.0], help="pause between messages")
    ap.add_argument("--spin-us", type=float, default=50.0, help="readers poll this long before sleeping")
    ap.add_argument("--slot-bytes", type=int, default=DEFAULT_SLOT_BYTES, help="larger messages span slots")
    args = ap.parse_args()
    for gap_us in args.gaps_us:
        for size in args.sizes:
            for n_readers in args.readers:
                case = run_case(size, n_readers, gap_us, args.spin_us, args.messages, args.slot_bytes)
                print(json.dumps(case), flush=True)


if __name__ == "__main__":
    main()
