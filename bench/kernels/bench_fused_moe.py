"""Micro-benchmark of the fused MoE experts (kernels/fused_moe.py) against their torch reference (moe_ref.py's
expert-by-expert loop) at the Qwen3-30B-A3B shape (hidden 2048, 128 experts of FFN 768, top 8; `--tp 2`: one
rank's half of every expert), bfloat16, T = 1, 8, 64, 256, 2048, 8192 tokens. The kernel is checked against
the reference on the GPU first.

One JSON line per T: GPU time of each in microseconds (bench_fused.time_us: back-to-back calls, launch
overhead hidden as under CUDA graphs), and the kernel against its limit: the larger of reading the experts
the routing touches (plus activations) at the H200's copy bandwidth and the routed FLOPs at its bf16 peak
(../shared/PERF.md). Routing is uniform, from random router logits, as with random weights.
Run on the device machine from the repo root: python3 bench/kernels/bench_fused_moe.py [--tp 2] [--tokens ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from asyncllm.kernels import fused_moe
from asyncllm.kernels.moe_ref import experts_ref, route_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_fused, beside this file
from bench_fused import COPY_TB_S, compare, time_us

BF16_TFLOPS = 790  # measured dense bf16 matmul on the H200 (PERF.md)
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
TOKENS = [1, 8, 64, 256, 2048, 8192]
DTYPE = torch.bfloat16
DEVICE = "cuda"  # tests/kernels/test_bench_fused_moe.py runs `run` on CPU shapes through the interpreter


def run(tokens: int, inter: int, gen: torch.Generator) -> dict:
    dtype, dev = DTYPE, DEVICE
    w13 = (torch.randn(EXPERTS, 2 * inter, HIDDEN, device=dev, generator=gen) * HIDDEN**-0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, inter, device=dev, generator=gen) * inter**-0.5).to(dtype)
    x = torch.randn(tokens, HIDDEN, device=dev, generator=gen).to(dtype)
    weights, ids = route_ref(torch.randn(tokens, EXPERTS, device=dev, generator=gen).to(dtype), TOP_K, True)
    check = compare(fused_moe.fused_moe(x, w13, w2, weights, ids), experts_ref(x, w13, w2, weights, ids))
    kernel_us, _ = time_us(lambda: fused_moe.fused_moe(x, w13, w2, weights, ids))
    ref_us, _ = time_us(lambda: experts_ref(x, w13, w2, weights, ids), inner=3, samples=5)
    touched = int(ids.unique().numel())
    rows = tokens * TOP_K
    size = x.element_size()
    moved = (touched * 3 * HIDDEN * inter + tokens * HIDDEN * 2 + rows * (3 * inter + HIDDEN)) * size
    flops = rows * 2 * 3 * HIDDEN * inter
    limit_us = max(moved / (COPY_TB_S * 1e6), flops / (BF16_TFLOPS * 1e6))
    return dict(
        kernel="fused_moe",
        tokens=tokens,
        inter=inter,
        experts_touched=touched,
        block_m=fused_moe.block_m_for(rows, EXPERTS),
        kernel_us=round(kernel_us, 2),
        ref_us=round(ref_us, 2),
        speedup=round(ref_us / kernel_us, 2),
        limit_us=round(limit_us, 2),
        percent_of_limit=round(100 * limit_us / kernel_us, 1),
        bound="bytes" if moved / (COPY_TB_S * 1e6) >= flops / (BF16_TFLOPS * 1e6) else "flops",
        **check,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1, help="ranks sharing each expert's intermediate dimension")
    ap.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs a CUDA device"}))
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in args.tokens:
        print(json.dumps(run(tokens, INTER // args.tp, gen)), flush=True)


if __name__ == "__main__":
    main()
