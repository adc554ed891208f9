"""Cascade decode attention against the plain decode kernel (kernels/paged_attention_cascade.py), through the
Triton backend's plans: one decode step of 256 sequences in 16 groups of 16, each group sharing a 2,048-token
prefix (its blocks physically shared, as prefix-cache hits are) plus 128-384 unique tokens; Qwen3-0.6B's heads
(16 query / 8 KV, head_dim 128), bf16, blocks of 16. Both plans replayed as CUDA graphs (as decode steps run),
one layer's attention per call, the cascade at several prefix split counts (`--prefix-splits`; 0: the
engine's choice, which `CascadeDecode.prefix_splits` overrides). Prints one JSON line per plan, then the best
ratio: microseconds per call, the bytes each must read (K and V: the plain kernel every sequence's keys,
cascade each prefix once per unit) and the logical bytes (every sequence's keys) per second.

Also the host side (any device): the backend's plan per step at 256 rows, its work list staged, plain and
cascade, with the prefixes shared and with none shared (what a step that shares nothing pays for the grouping).

Usage: python3 bench/kernels/bench_cascade.py [--groups 16] [--prefix 2048] [--prefix-splits 0,1,2,4] [--host-only]
(on CPU, the host side only: TRITON_INTERPRET=1 python3 bench/kernels/bench_cascade.py)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

from asyncllm.attention.backend import AttentionMetadata, PlanBounds
from asyncllm.attention.cascade import CascadeDecode
from asyncllm.attention.triton_backend import TritonAttentionBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK, MAX_LEN = 16, 8, 128, 16, 4096
KEY_BYTES = 2 * KV_HEADS * HEAD_DIM * 2  # K and V of one token in one layer, bf16
UNIQUE = (128, 384)  # each sequence's own tokens after its group's prefix


def step(groups: int, members: int, prefix: int, shared: bool, seed: int = 0):
    """Block tables and lengths of one decode step; `shared` False gives every sequence its own prefix copy."""
    rng = random.Random(seed)
    next_block = 1
    rows, lens = [], []
    for _ in range(groups):
        common = list(range(next_block, next_block + prefix // BLOCK))
        next_block += len(common)
        for _ in range(members):
            n = prefix + rng.randint(*UNIQUE)
            own_prefix = common
            if not shared:
                own_prefix = list(range(next_block, next_block + len(common)))
                next_block += len(common)
            own = list(range(next_block, next_block + -(-(n - prefix) // BLOCK)))
            next_block += len(own)
            rows.append(own_prefix + own)
            lens.append(n)
    tables = np.zeros((len(rows), MAX_LEN // BLOCK), dtype=np.int32)
    for i, r in enumerate(rows):
        tables[i, : len(r)] = r
    return tables, lens, next_block


def metadata(tables: np.ndarray, lens: list[int], device: torch.device) -> AttentionMetadata:
    n = len(lens)
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=device),
        query_lens_cpu=[1] * n,
        seq_lens_cpu=lens,
        max_query_len=1,
        max_seq_len=max(lens),
        block_tables_cpu=tables,
        block_size=BLOCK,
    )


def host_us(backend: TritonAttentionBackend, meta: AttentionMetadata, bounds: PlanBounds, variant, reps=300):
    """The plan and its work list written into a host buffer (what the worker stages), per step."""
    staged = np.zeros(backend.work_size(bounds), dtype=np.int32)

    def plan_and_stage() -> None:
        work = backend.plan(meta, bounds, variant).work
        staged[: len(work)] = work

    plan_and_stage()
    start = time.perf_counter()
    for _ in range(reps):
        plan_and_stage()
    return (time.perf_counter() - start) / reps * 1e6


def bench_host(args: argparse.Namespace, device: torch.device) -> None:
    backend = TritonAttentionBackend(device, torch.bfloat16, KV_HEADS, cascade=CascadeDecode(HEADS // KV_HEADS))
    n = args.groups * 16
    bounds = PlanBounds(n, n, MAX_LEN, decode_only=True)
    for shared in (True, False):
        tables, lens, _ = step(args.groups, 16, args.prefix, shared)
        meta = metadata(tables, lens, torch.device("cpu"))
        plan = backend.plan(meta, bounds)
        print(json.dumps({"host": "plan", "rows": n, "prefixes_shared": shared, "cascade": plan.graph_variant == 1,
                          "plain_us": round(host_us(backend, meta, bounds, 0), 1),
                          "auto_us": round(host_us(backend, meta, bounds, None), 1)}))  # fmt: skip


def graphed_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench_device(args: argparse.Namespace, device: torch.device, timer=None, dtype=torch.bfloat16) -> None:
    """`timer`: microseconds of one call (default: CUDA-graph replays); a CPU test passes its own, float32."""
    timer = timer or graphed_us
    tables, lens, num_blocks = step(args.groups, 16, args.prefix, shared=True)
    n = len(lens)
    bounds = PlanBounds(n, n, MAX_LEN, decode_only=True)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, device=device, dtype=dtype) for _ in "kv")
    q = torch.randn(n, HEADS, HEAD_DIM, device=device, dtype=dtype)
    logical = sum(lens) * KEY_BYTES
    results = {}
    outs = {}
    runs = [("plain", 0, None)] + [("cascade", 1, s or None) for s in args.prefix_splits]
    for name, variant, prefix_splits in runs:
        cascade = CascadeDecode(HEADS // KV_HEADS, prefix_splits=prefix_splits)
        backend = TritonAttentionBackend(device, dtype, KV_HEADS, cascade=cascade)
        meta = metadata(tables, lens, device)
        work = torch.zeros(backend.work_size(bounds), dtype=torch.int32, device=device)
        plan = backend.plan(meta, bounds, variant)
        work[: len(plan.work)].copy_(torch.tensor(plan.work, dtype=torch.int32))
        plan.bind(work[: len(plan.work)])
        meta.plan = plan
        read = logical
        if variant == 1:
            read = (sum(lens) - args.prefix * n + args.prefix * args.groups) * KEY_BYTES
        us = timer(lambda meta=meta, backend=backend: backend.attend(q, k_cache, v_cache, meta, HEAD_DIM**-0.5))
        label = name if variant == 0 else f"cascade/{plan.cascade.prefix_splits}"
        outs[label] = backend.attend(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)
        results[label] = us
        print(json.dumps({"kernel": label, "seqs": n, "groups": args.groups, "prefix": args.prefix, "us": round(us, 1),
                          "gb_read": round(read / 1e9, 3), "read_tb_s": round(read / us / 1e6, 2),
                          "logical_tb_s": round(logical / us / 1e6, 2)}))  # fmt: skip
    best = min((k for k in results if k != "plain"), key=results.__getitem__)
    err = max((outs[k].float() - outs["plain"].float()).abs().max().item() for k in outs)
    print(
        json.dumps({"cascade_speedup": round(results["plain"] / results[best], 2), "best": best, "max_abs_diff": err})
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--host-only", action="store_true")
    ap.add_argument(
        "--prefix-splits",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[0, 1, 2, 4],
        help="cascade runs, each with these prefix splits (0: the engine's choice)",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda and not args.host_only:
        bench_device(args, torch.device("cuda"))
    bench_host(args, torch.device("cuda" if cuda else "cpu"))


if __name__ == "__main__":
    main()
