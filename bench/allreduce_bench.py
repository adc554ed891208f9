"""NCCL against the custom all-reduce (one-shot over symmetric memory), through `ParallelContext`, on 2 GPUs.

Two spawned ranks build two contexts each over one store: one with the custom path (its buffer sized for the
largest case), one NCCL only. Per [rows, hidden] bf16 case: exactness (custom sum == NCCL sum bit for bit, on
both ranks, eager and replayed from a CUDA graph) and the time per all-reduce: eager (host loop, synchronized
at the end) and in a graph (`--graph-ops` all-reduces captured in one graph, each on its own tensor as decode
layers do; replay time / ops). Prints one JSON line per case (rank 0's times), after a `setup` line saying
whether the custom path is on. A watchdog ends both ranks after `--timeout` seconds: the run always exits.

Device machine (2 GPUs): timeout 90 python3 bench/allreduce_bench.py [--rows 1 8 64 256] [--hidden 4096]
    [--iters 200] [--graph-ops 64] [--replays 20] [--timeout 55]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import queue
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

WORLD = 2


def rank_main(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """One rank: every case, in the same order as its peer (collectives and captures must match)."""
    faulthandler.dump_traceback_later(max(1.0, args.timeout - 5), exit=False)  # where a hang is, before the kill
    try:
        _run_rank(rank, port, args, results)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise SystemExit(1) from None


def _run_rank(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    import torch
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    from asyncllm.distributed.parallel_state import ParallelContext

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=30))
    capacity = max(args.rows) * args.hidden * 2
    start = time.perf_counter()
    custom = ParallelContext(PrefixStore("custom/", store), rank, WORLD, device, custom_all_reduce_bytes=capacity)
    nccl = ParallelContext(PrefixStore("nccl/", store), rank, WORLD, device)
    if rank == 0:
        results.put(
            {
                "case": "setup",
                "custom_all_reduce": custom.custom_all_reduce,
                "buffer_bytes": capacity,
                "setup_s": round(time.perf_counter() - start, 2),
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device),
            }
        )
    if not custom.custom_all_reduce:
        raise RuntimeError("the custom all-reduce is off (its set-up warning above says why): nothing to compare")
    generator = torch.Generator(device=device)
    generator.manual_seed(100 + rank)
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, generator=generator, device=device).to(torch.bfloat16)  # [rows, hidden]
        row: dict[str, Any] = {"case": "allreduce", "rows": rows, "hidden": args.hidden, "dtype": "bfloat16"}
        row["bytes"] = x.numel() * x.element_size()
        row["exact_eager"] = _exact_eager(custom, nccl, x)
        row["exact_graph"] = _exact_graph(custom, nccl, x)
        for name, context in (("nccl", nccl), ("custom", custom)):
            row[f"{name}_eager_us"] = _eager_us(context, x, args.iters)
            row[f"{name}_graph_us"] = _graph_us(context, x, args.graph_ops, args.replays)
        row["graph_speedup"] = round(row["nccl_graph_us"] / row["custom_graph_us"], 2)
        if rank == 0:
            results.put(row)
    custom.close()
    nccl.close()


def _agree(nccl: Any, mine: bool) -> bool:
    """True when every rank's check passed."""
    return bool(nccl.min_int(int(mine)))


def _exact_eager(custom: Any, nccl: Any, x: Any) -> bool:
    import torch

    got, want = x.clone(), x.clone()
    custom.all_reduce(got)
    nccl.all_reduce(want)
    everyone = nccl.all_gather(got.view(1, -1))  # [world, numel]: every rank holds the same bits
    return _agree(nccl, torch.equal(got, want) and bool((everyone == got.view(1, -1)).all()))


def _exact_graph(custom: Any, nccl: Any, x: Any) -> bool:
    import torch

    got = x.clone()
    custom.all_reduce(got)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        custom.all_reduce(got)
    got.copy_(x)
    graph.replay()
    want = x.clone()
    nccl.all_reduce(want)
    torch.cuda.synchronize()
    return _agree(nccl, torch.equal(got, want))


def _eager_us(context: Any, x: Any, iters: int) -> float:
    import torch

    buf = x.clone()
    for _ in range(5):
        context.all_reduce(buf)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        context.all_reduce(buf)
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / iters * 1e6, 2)


def _graph_us(context: Any, x: Any, ops: int, replays: int) -> float:
    import torch

    bufs = [x.clone() for _ in range(ops)]  # one tensor per all-reduce, as decode layers have
    context.all_reduce(bufs[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for buf in bufs:
            context.all_reduce(buf)
    graph.replay()  # the first launch uploads the graph
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    elapsed_ms = start.elapsed_time(end)
    del graph
    return round(elapsed_ms / (replays * ops) * 1e3, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--graph-ops", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=55.0, help="seconds before the watchdog ends both ranks")
    args = parser.parse_args()

    import torch
    from torch._C._distributed_c10d import TCPStore

    if torch.cuda.device_count() < WORLD:
        print(json.dumps({"case": "setup", "error": f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}"}))
        return 1
    # The store lives here, in the watchdog: ranks come and go, it stays.
    store = TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=rank_main, args=(r, store.port, args, results)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout
    failed = False
    while any(p.is_alive() for p in procs) or not results.empty():
        if time.monotonic() > deadline:
            print(json.dumps({"case": "watchdog", "error": "ranks still running at the deadline: killed"}))
            failed = True
            break
        try:
            item = results.get(timeout=0.2)
        except queue.Empty:
            continue
        if "error" in item:
            print(f"rank {item['rank']} failed:\n{item['error']}", file=sys.stderr)
            print(json.dumps({"case": "error", "rank": item["rank"], "error": item["error"].strip().splitlines()[-1]}))
            failed = True
            deadline = min(deadline, time.monotonic() + 5)  # its peer may wait in a collective for ever
        else:
            print(json.dumps(item), flush=True)
            failed = failed or item.get("exact_eager") is False or item.get("exact_graph") is False
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        failed = failed or proc.exitcode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
