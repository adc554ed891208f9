"""What the core process's pipe costs per step: one step's outputs (B plain decode deltas, with the ids and
texts a server's requests have) encoded and pickled on the core's side, through a pipe to another process,
unpickled and decoded on the front's side. Prints one JSON line per batch size: microseconds for each part
(median of `--steps` steps) and the message's bytes, and the same for pickling the `RequestDelta`s as they
are (what the columns avoid).

    python bench/core_pipe.py [--batch 1 64 256] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import statistics
import time
import uuid
from typing import Any

from asyncllm.async_engine.core_wire import decode_step, encode_step
from asyncllm.core.output_processor import RequestDelta

_STATS = {"num_running": 256, "num_waiting": 0, "num_free_blocks": 100, "num_total_blocks": 4096}


def _echo(down: Any, up: Any) -> None:
    """The far side: read each message and answer with its receive time, so one way is measured alone."""
    while True:
        data = down.recv_bytes()
        if not data:
            return
        up.send_bytes(pickle.dumps(time.monotonic()))


def _deltas(batch: int) -> list[RequestDelta]:
    ids = [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(batch)]
    return [RequestDelta(rid, [1000 + i], " token") for i, rid in enumerate(ids)]


def measure(batch: int, steps: int, down: Any, up: Any) -> dict[str, Any]:
    deltas = _deltas(batch)
    encode, send, decode, whole = [], [], [], []
    size = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        data = pickle.dumps(encode_step([], _STATS, deltas), protocol=pickle.HIGHEST_PROTOCOL)
        t1 = time.perf_counter()
        sent = time.monotonic()
        down.send_bytes(data)
        arrived = pickle.loads(up.recv_bytes())
        t2 = time.perf_counter()
        decode_step(pickle.loads(data))
        t3 = time.perf_counter()
        pickle.loads(pickle.dumps(deltas, protocol=pickle.HIGHEST_PROTOCOL))
        t4 = time.perf_counter()
        encode.append(t1 - t0)
        send.append(arrived - sent)
        decode.append(t3 - t2)
        whole.append(t4 - t3)
        size = len(data)
    us = 1e6
    return {
        "bench": "core_pipe",
        "batch": batch,
        "bytes": size,
        "core_encode_pickle_us": round(statistics.median(encode) * us, 1),
        "pipe_one_way_us": round(statistics.median(send) * us, 1),
        "pipe_one_way_us_p10_p90": [round(q * us, 1) for q in statistics.quantiles(send, n=10)[::8]],
        "front_unpickle_decode_us": round(statistics.median(decode) * us, 1),
        "deltas_pickled_whole_us": round(statistics.median(whole) * us, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    # Two one-way pipes, as ProcClient has (multiprocessing's duplex Pipe is a socket pair).
    down_r, down_w = ctx.Pipe(duplex=False)
    up_r, up_w = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_echo, args=(down_r, up_w), daemon=True)
    child.start()
    try:
        for batch in args.batch:
            print(json.dumps(measure(batch, args.steps, down_w, up_r)))
    finally:
        down_w.send_bytes(b"")
        child.join(5)


if __name__ == "__main__":
    main()
