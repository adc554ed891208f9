"""Micro-benchmark of the CPU decode step's C ops (kernels/cpu_decode_ops.c) against their torch specification
(cpu_decode_ops_ref.py: plain torch, heavier than the torch path's own scaled_dot_product_attention for
attention), at SmolLM2-135M's shapes (hidden 576, 9 query and 3 KV heads of 64, intermediate 1536),
batch 1. Each op is timed the way the decode step runs it: right after a [1, 576] x [576, 3072] int4 GEMV (torch's
CPU kernel), whose streamed weights evict the op's code and data from the caches; the GEMV alone is subtracted.
One JSON line per op: microseconds per call (median of repeats), C against torch, and the speed-up.
Usage: python bench/kernels/bench_cpu_decode_ops.py [--threads 1] [--keys 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from asyncllm.kernels import cpu_decode_native
from asyncllm.kernels.cpu_decode_ops_ref import add_rms_norm_ref, decode_attention_ref, rope_kv_write_ref, silu_mul_ref
from asyncllm.kernels.quant_matmul_ref import pack_codes
from asyncllm.quantization import cpu_int4

HIDDEN, HQ, HKV, D, INTER, BLOCK = 576, 9, 3, 64, 1536, 16


def us_after_gemv(op: Callable[[], object], gemv: Callable[[], object], repeats: int) -> float:
    """Median microseconds of `gemv(); op()` less the GEMV's own median."""

    def pair() -> None:
        gemv()
        op()

    def median(fn: Callable[[], object]) -> float:
        for _ in range(20):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return (median(pair) - median(gemv)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keys", type=int, default=300, help="the sequence's keys (attention)")
    ap.add_argument("--repeats", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_decode_native.load(Path(tempfile.mkdtemp()))
    if ops is None:
        raise SystemExit("no C compiler built kernels/cpu_decode_ops.c")
    codes = torch.randint(0, 16, (2 * INTER, HIDDEN), dtype=torch.int32)
    w = cpu_int4.pack(
        pack_codes(codes, 4), torch.rand(2 * INTER, HIDDEN // 32) * 0.01, None, None, bits=4, group_size=32
    )
    x_in = torch.randn(1, HIDDEN).to(torch.bfloat16)

    def gemv() -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x_in, w.packed, w.group_size, w.scale_zeros)

    blocks = -(-args.keys // BLOCK)
    k_cache, v_cache = torch.randn(blocks + 1, BLOCK, HKV, D), torch.randn(blocks + 1, BLOCK, HKV, D)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    x, residual, weight = torch.randn(1, HIDDEN).to(torch.bfloat16), torch.randn(1, HIDDEN), torch.rand(HIDDEN)
    qkv = (torch.randn(1, (HQ + 2 * HKV) * D) * 0.1).to(torch.bfloat16)
    angles = torch.rand(1, D // 2)
    cos, sin, slots = angles.cos(), angles.sin(), torch.tensor([args.keys - 1])
    q, gate_up = torch.randn(1, HQ, D), torch.randn(1, 2 * INTER).to(torch.bfloat16)
    normed, attn_out, act = (torch.empty(1, n, dtype=torch.bfloat16) for n in (HIDDEN, HQ * D, INTER))
    k_rows, v_rows = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    lib, ptr = ops.lib, torch.Tensor.data_ptr  # the raw calls, as the decode step makes them (checked once)
    tables_p, k_p, v_p = ptr(tables), ptr(k_cache), ptr(v_cache)
    scratch = torch.empty(cpu_decode_native.attention_scratch(HQ // HKV, args.keys, D))

    def c_norm() -> None:
        lib.asl_add_rms_norm(ptr(x), 2, 1, ptr(residual), ptr(weight), 1e-5, 1, HIDDEN, ptr(normed), 1)

    def c_rope() -> None:
        lib.asl_rope_kv_write(ptr(qkv), 2, None, 1, HQ, HKV, D, ptr(cos), ptr(sin), ptr(slots), ptr(q), k_p, v_p)

    def c_attention() -> None:
        lib.asl_decode_attention(ptr(q), k_p, v_p, tables_p, blocks, args.keys, BLOCK, 1, HQ, HKV, D, D**-0.5,
                                 ptr(attn_out), 1, ptr(scratch))  # fmt: skip

    def c_silu() -> None:
        lib.asl_silu_mul(ptr(gate_up), 2, 1, INTER, ptr(act), 1)

    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "add_rms_norm": (c_norm, lambda: add_rms_norm_ref(x, residual, weight, 1e-5, True)[1].to(torch.bfloat16)),
        "rope_kv_write": (c_rope, lambda: rope_kv_write_ref(qkv, None, cos, sin, slots, HQ, k_rows, v_rows)),
        "decode_attention": (
            c_attention,
            lambda: decode_attention_ref(q, k_cache, v_cache, tables, args.keys, D**-0.5).to(torch.bfloat16),
        ),
        "silu_mul": (c_silu, lambda: silu_mul_ref(gate_up).to(torch.bfloat16)),
    }
    with torch.inference_mode():
        for name, (c_op, torch_op) in cases.items():
            c_us, torch_us = (us_after_gemv(op, gemv, args.repeats) for op in (c_op, torch_op))
            row = {"op": name, "threads": args.threads, "c_us": round(c_us, 2), "torch_us": round(torch_us, 2)}
            print(json.dumps(row | {"speedup": round(torch_us / max(c_us, 1e-3), 1)}))


if __name__ == "__main__":
    main()
