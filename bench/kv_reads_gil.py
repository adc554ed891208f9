"""The disk tier's reads beside a busy step thread, on CPU: in a reader process against on threads (issue 44).

Writes `--files` KV block files of `--block-mib` MiB, then reads them all back into host slots: first (each
slot's first write since the pool was mapped), then alone, and beside a thread that launches small torch ops in a
loop as the engine's step thread does (each op gives the GIL up and takes it back), once with the reads on threads
of this process and once in the reader process. Prints one JSON line: each way's seconds and GB/s, and how many
ops the busy thread got through a millisecond.
Usage: python bench/kv_reads_gil.py [--files 256] [--block-mib 2.25] [--threads 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

from asyncllm.worker.kv_disk import DiskKVStore
from asyncllm.worker.kv_host import HostKVPool

FINGERPRINT = bytes(range(16))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=256)
    ap.add_argument("--block-mib", type=float, default=2.25)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    half = int(args.block_mib * 2**20) // 2  # one layer's keys (or values) in a block, bytes; one device block
    caches = [(torch.zeros(1, half, dtype=torch.uint8), torch.zeros(1, half, dtype=torch.uint8))]
    root = Path(tempfile.mkdtemp(prefix="asyncllm-kv-reads-"))
    results: dict[str, object] = {"files": args.files, "block_bytes": None, "threads": args.threads}
    for way in ("threads", "process"):
        pool = HostKVPool(caches, args.files, torch.device("cpu"), shared=way == "process")
        results["block_bytes"] = pool.block_bytes
        store = DiskKVStore(root / way, FINGERPRINT, pool, 1 << 40, args.threads, reader_process=way == "process")
        pool.host.random_(0, 255)
        store.write([(h, h, h.to_bytes(16, "little")) for h in range(args.files)], None)
        while len(store.on_disk()) < args.files:
            time.sleep(0.01)
        jobs = [(h, (h + 1) % args.files, h.to_bytes(16, "little")) for h in range(args.files)]
        seconds, _ = _timed(store, jobs, False)  # the page cache warm, as after a restart's writes
        results[f"{way}_first"] = {
            "seconds": round(seconds, 4),
            "gb_s": round(args.files * pool.block_bytes / seconds / 1e9, 2),
        }
        for busy in (False, True):
            seconds, ops = _timed(store, jobs, busy)
            results[f"{way}{'_beside_busy' if busy else '_alone'}"] = {
                "seconds": round(seconds, 4),
                "gb_s": round(args.files * pool.block_bytes / seconds / 1e9, 2),
                "busy_ops_per_ms": round(ops / seconds / 1e3, 1) if busy else None,
            }
        store.close()
        pool.close()
    print(json.dumps(results))


def _timed(store: DiskKVStore, jobs: list[tuple[int, int, bytes]], busy: bool) -> tuple[float, int]:
    stop = threading.Event()
    count = [0]

    def step_thread() -> None:  # small torch ops, as a step launches them
        x = torch.zeros(64)
        while not stop.is_set():
            x.add_(1.0)
            count[0] += 1

    spinner = threading.Thread(target=step_thread)
    if busy:
        spinner.start()
        while count[0] == 0:  # the busy thread runs before the reads begin (tiny reads end within its start)
            time.sleep(0.0001)
    start = time.perf_counter()
    assert all(store.load(jobs))
    seconds = time.perf_counter() - start
    stop.set()
    if busy:
        spinner.join()
    return seconds, count[0]


if __name__ == "__main__":
    main()
