"""Micro-benchmark of the CPU engine's seeded draw (kernels/sampling_cpu.py) against the torch reference it
reproduces (sampling_ref.gumbel_argmax_ref), at 1, 8 and 64 rows over SmolLM2's and Qwen3's vocabularies,
every row sampled (temperature 0.7). Each case first checks that both give the same tokens. One JSON line per
case: milliseconds per draw (median of repeats) and the speed-up.
Usage: python bench/kernels/bench_sampling_cpu.py [--threads 1] [--rows 1 8 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from asyncllm.kernels.sampling_cpu import gumbel_argmax_cpu
from asyncllm.kernels.sampling_ref import gumbel_argmax_ref


def ms_per_call(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49_152, 151_936])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for rows in args.rows:
            logits = 4 * torch.randn(rows, vocab, generator=gen)
            temperature = torch.full((rows,), 0.7)
            seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
            offsets = torch.arange(rows, dtype=torch.int64)
            ref = gumbel_argmax_ref(logits, temperature, seeds, offsets)
            fast = gumbel_argmax_cpu(logits, temperature, seeds, offsets)
            row: dict[str, object] = {
                "kernel": "gumbel_argmax_cpu",
                "threads": args.threads,
                "rows": rows,
                "vocab": vocab,
            }
            if not torch.equal(ref, fast):
                print(json.dumps(row | {"error": "tokens differ from the reference's"}))
                continue
            repeats = max(3, 64 // rows)
            case = (logits, temperature, seeds, offsets)
            ref_ms = ms_per_call(lambda case=case: gumbel_argmax_ref(*case), repeats)  # type: ignore[misc]
            fast_ms = ms_per_call(lambda case=case: gumbel_argmax_cpu(*case), repeats)  # type: ignore[misc]
            row |= {"ms": round(fast_ms, 3), "reference_ms": round(ref_ms, 3), "speedup": round(ref_ms / fast_ms, 2)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
