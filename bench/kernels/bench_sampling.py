"""Micro-benchmark of the seeded Gumbel-max draw (kernels/sampling.py) over its launch shapes: programs per SM
(how many vocabulary splits a row gets), columns per tile and warps per program, at W1's batch (256 rows, the
Qwen3 vocabulary of 151,936 columns), a middling batch and batch 1, bfloat16 logits as the LM head writes them.

Every variant is first checked against the default's tokens (the draws do not depend on the launch shape).
One JSON line per (rows, variant): GPU time in microseconds (back-to-back launches, bench_fused.time_us), the
logits' bytes over that time as a share of copy bandwidth. Then the cost of a token bitmask (structured
output) at the default shape: no bitmask, a random ~50 % mask on every row, and on half the rows (the others
unconstrained), each checked to draw only allowed tokens. A last line names the best variant per batch.
Run on the device machine from the repo root: python3 bench/kernels/bench_sampling.py (under a minute).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from asyncllm.kernels import sampling

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_fused, beside this file
from bench_fused import COPY_TB_S, time_us

VOCAB = 151_936


def sweep(rows: int, variants: list[tuple[int, int, int]], gen: torch.Generator) -> tuple[float, str]:
    """Time every variant at `rows`; returns the best (us, name)."""
    logits = (4 * torch.randn(rows, VOCAB, device="cuda", generator=gen)).to(torch.bfloat16)
    temperature = torch.full((rows,), 0.6, device="cuda")
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 7919
    offsets = torch.arange(rows, dtype=torch.int64, device="cuda") % 1000
    want = sampling.gumbel_argmax(logits, temperature, seeds, offsets)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = (float("inf"), "")
    for pps, block_v, warps in variants:
        name = f"pps{pps}_v{block_v}_w{warps}"

        def draw(pps: int = pps, block_v: int = block_v, warps: int = warps) -> torch.Tensor:
            return sampling.gumbel_argmax(
                logits, temperature, seeds, offsets, programs_per_sm=pps, block_v=block_v, num_warps=warps
            )

        if not torch.equal(draw(), want):
            print(json.dumps({"rows": rows, "variant": name, "error": "tokens differ from the default's"}))
            continue
        us, _ = time_us(draw)
        row = {
            "kernel": "gumbel_argmax",
            "rows": rows,
            "variant": name,
            "splits": sampling.num_vocab_splits(rows, VOCAB, num_sms, pps, block_v),
            "us": round(us, 1),
            "pct_of_copy_bw": round(100 * logits.numel() * logits.element_size() / (us * 1e-6) / (COPY_TB_S * 1e12), 1),
        }
        print(json.dumps(row), flush=True)
        best = min(best, (us, name))
    return best


def masked(rows: int, gen: torch.Generator) -> None:
    """Time the default launch without a bitmask, with one on every row and with one on half the rows."""
    logits = (4 * torch.randn(rows, VOCAB, device="cuda", generator=gen)).to(torch.bfloat16)
    temperature = torch.full((rows,), 0.6, device="cuda")
    temperature[::4] = 0.0  # some greedy rows: they take the masked argmax
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 7919
    offsets = torch.arange(rows, dtype=torch.int64, device="cuda") % 1000
    words = -(-VOCAB // 32)
    # Uniform random words: every bit set with probability 1/2 (xgrammar's layout, one mask per row).
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), device="cuda", generator=gen, dtype=torch.int32)
    every_row = torch.arange(rows, dtype=torch.int32, device="cuda")
    half_rows = torch.where(every_row % 2 == 0, every_row, -1).to(torch.int32)
    cases: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {
        "no_mask": (None, None),
        "mask_all_rows": (bitmask, every_row),
        "mask_half_rows": (bitmask, half_rows),
    }
    base_us = None
    for name, (bm, mask_rows) in cases.items():

        def draw(bm: torch.Tensor | None = bm, mask_rows: torch.Tensor | None = mask_rows) -> torch.Tensor:
            return sampling.gumbel_argmax(logits, temperature, seeds, offsets, bm, mask_rows)

        if bm is not None and mask_rows is not None:
            tokens = draw()
            mask_row = mask_rows.long()
            word = bm[mask_row.clamp(min=0), tokens // 32]
            allowed = ((word >> (tokens % 32).int()) & 1).bool() | (mask_row < 0)
            if not bool(allowed.all()):
                print(json.dumps({"rows": rows, "variant": name, "error": "a disallowed token was drawn"}))
                continue
        us, _ = time_us(draw)
        base_us = us if base_us is None else base_us
        row = {"kernel": "gumbel_argmax", "rows": rows, "variant": name, "us": round(us, 1)}
        print(json.dumps(row | {"pct_over_no_mask": round(100 * (us / base_us - 1), 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 64, 1])
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--block-v", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--no-mask", action="store_true", help="skip the token-bitmask cases")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = list(itertools.product(args.programs_per_sm, args.block_v, args.num_warps))
    best = {rows: sweep(rows, variants, gen) for rows in args.rows}
    if not args.no_mask:
        for rows in args.rows:
            masked(rows, gen)
    summary = {r: {"variant": name, "us": round(us, 1)} for r, (us, name) in best.items()}
    print(json.dumps({"kernel": "gumbel_argmax", "best": summary}))


if __name__ == "__main__":
    main()
