"""What a tensor-parallel step costs to reach the workers: encode a 256-sequence decode step as a delta
(`StepEncoder`), broadcast it through the shared-memory ring, and decode it back into a `SchedulerOutput`
in a reader process (`StepDecoder`), as `MultiProcExecutor` and its workers do.

Each message carries two clock stamps ahead of the encoded step (before encoding, after encoding; the one
CLOCK_MONOTONIC of the host); the reader stamps after `read()` and after `decode()`. Printed per case, p50/p99
in microseconds: encode, broadcast (write start to bytes in the reader), decode, and all three end to end.
The writer waits until every reader has decoded a message (sleeping, so that on a small host it does not
take the readers' core), then `--gap-us` more, then encodes. A reader still polling (`--spin-us` longer than
the gap plus the encode) takes the message hot; otherwise asleep, as workers are between steps that take
milliseconds (their default spin is 50 us), and the broadcast includes the wake-up.

python bench/ring_step_latency.py [--seqs 256] [--blocks 64] [--messages 3000] [--readers 1] [--gaps-us 20 2000]
                                  [--spin-us 50]
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
from asyncllm.distributed.shm_ring import DEFAULT_SPIN_S
from asyncllm.executor.step_codec import StepDecoder, StepEncoder
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import PLACEHOLDER, NewRequestData, ScheduledSeq, SchedulerOutput

_STAMPS = struct.Struct("<QQ")
_WARMUP = 200


def reader_main(handle: RingHandle, results: Any, decoded: Any, spin_s: float) -> None:
    samples: list[tuple[int, int, int, int]] = []  # (encode, broadcast, decode, total) ns
    decoder = StepDecoder()
    with ShmRingReader.attach(handle, spin_s=spin_s) as reader:
        results.put("ready")
        try:
            while True:
                data = reader.read()
                t_read = time.perf_counter_ns()
                step = decoder.decode(data[_STAMPS.size :])
                t_done = time.perf_counter_ns()
                t0, t_encoded = _STAMPS.unpack_from(data)
                samples.append((t_encoded - t0, t_read - t_encoded, t_done - t_read, t_done - t0))
                assert step.seqs  # decoded for real
                decoded[handle.rank] += 1  # this reader's own counter: no lock, one writer
        except RingClosedError:
            pass
    results.put(samples[_WARMUP:])


def decode_steps(num_seqs: int, blocks: int) -> Any:
    """The first step admits `num_seqs` requests; then decode steps, each with one PLACEHOLDER input per
    sequence, a sequence crossing into a new block every 16 steps (block size 16)."""
    tables = [list(range(i * 10_000, i * 10_000 + blocks)) for i in range(num_seqs)]
    params = SamplingParams(temperature=0.6, max_tokens=1024)
    yield SchedulerOutput(
        seqs=[ScheduledSeq(f"req-{i}", [1, 2, 3], 0, list(t), True) for i, t in enumerate(tables)],
        new_requests=[NewRequestData(f"req-{i}", [1, 2, 3], params, i) for i in range(num_seqs)],
    )
    pos = blocks * 16 - 8
    while True:
        pos += 1
        for i, table in enumerate(tables):
            if (pos + i) % 16 == 0:
                table.append(table[-1] + 1)
        yield SchedulerOutput(
            seqs=[ScheduledSeq(f"req-{i}", [PLACEHOLDER], pos, list(t), True) for i, t in enumerate(tables)]
        )


def pause(gap_ns: int) -> None:
    if gap_ns >= 500_000:
        time.sleep(gap_ns / 1e9)
        return
    end = time.perf_counter_ns() + gap_ns
    while time.perf_counter_ns() < end:
        pass


def run_case(num_seqs: int, blocks: int, readers: int, gap_us: float, spin_us: float, messages: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    decoded: Any = ctx.RawArray("q", readers)  # messages decoded, per reader
    encoder = StepEncoder()
    steps = decode_steps(num_seqs, blocks)
    sizes = []
    with ShmRingWriter(readers) as writer:
        procs = [
            ctx.Process(target=reader_main, args=(writer.reader_handle(r), results, decoded, spin_us * 1e-6))
            for r in range(readers)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:
            assert results.get(timeout=60) == "ready"
        for sent in range(messages + _WARMUP + 1):
            step = next(steps)
            while min(decoded) < sent:  # the readers still decode the previous step (a worker would then run it)
                time.sleep(20e-6)  # sleep, not spin: on a small host a spinning writer delays the readers
            pause(int(gap_us * 1000))
            t0 = time.perf_counter_ns()
            message = encoder.encode(step)
            writer.write_parts((_STAMPS.pack(t0, time.perf_counter_ns()), message))
            sizes.append(len(message))
            writer.wait_until_read()
        writer.close()
        samples = [s for _ in procs for s in results.get(timeout=60)]
        for proc in procs:
            proc.join()
    out: dict[str, Any] = {"bench": "ring_step_latency", "seqs": num_seqs, "readers": readers, "gap_us": gap_us}
    out["spin_us"] = spin_us
    out["message_bytes_p50"] = int(statistics.median(sizes[1:]))
    for k, name in enumerate(("encode", "broadcast", "decode", "total")):
        q = statistics.quantiles([s[k] / 1000 for s in samples], n=100, method="inclusive")
        out[f"{name}_p50_us"], out[f"{name}_p99_us"] = round(q[49], 1), round(q[98], 1)
    out["cpus"] = os.cpu_count()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per sequence when decoding starts")
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--readers", type=int, nargs="+", default=[1])
    ap.add_argument("--gaps-us", type=float, nargs="+", default=[20.0, 2000.0])
    ap.add_argument("--spin-us", type=float, default=DEFAULT_SPIN_S * 1e6, help="readers poll this long, then sleep")
    args = ap.parse_args()
    for gap_us in args.gaps_us:
        for readers in args.readers:
            case = run_case(args.seqs, args.blocks, readers, gap_us, args.spin_us, args.messages)
            print(json.dumps(case), flush=True)


if __name__ == "__main__":
    main()
