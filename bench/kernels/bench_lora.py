"""The batched LoRA kernels (kernels/lora.py) against the base layer's GEMM they ride on: Qwen3-0.6B's packed
projections (qkv 1024->2048+1024+1024 in 3 shards, o 2048->1024, gate_up 1024->2x3072, down 3072->1024), bf16,
rank 16, 8 adapter slots; M = 1, 64, 256 rows (decode batches, one adapter per row, round robin), 2048 (a
prefill chunk of 8 adapters' prompts) and 8192 (W1's prompt steps, run eagerly: past the largest graph). GPU
time per call from CUDA events over replays of a CUDA graph (how decode runs), for F.linear alone and for
`lora_add` alone: on the path `plan_lora_launch` picks (`lora_us`, `path`, `launches` per site, `splits`,
`tiles`: column tiles a fused program takes), and forced onto each path (`fused_us`, `split_us`: the figures
to tune lora_plan.py's constants by). `lora_over_gemm` is what LoRA adds to the layer; `run52_lora_us` the
shrink+expand pair of run 52 (bench/RESULTS.md) at the same row. Also the bytes the kernels must move (each
used slot's A and B, the rows read and the output read and written) as a bandwidth against the copy
bandwidth (`COPY_TB_S`, ../shared/PERF.md). One JSON line per (layer, M), then one per M summing the four
layers (what LoRA adds to a decoder layer)."""

from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F

from asyncllm.kernels.lora import lora_add
from asyncllm.kernels.lora_plan import plan_lora_blocks, plan_lora_launch
from asyncllm.worker.gemm_layout import graph_time_us

SHAPES = {  # layer -> (in, output shards)
    "qkv": (1024, (2048, 1024, 1024)),
    "o": (2048, (1024,)),
    "gate_up": (1024, (3072, 3072)),
    "down": (3072, (1024,)),
}
RANK, SLOTS = 16, 8
COPY_TB_S = 4.25
RUN52_US = {  # (layer, M) -> the two-launch kernels' us in run 52 (commit 384478a), for comparison
    ("qkv", 1): 5.72, ("qkv", 64): 6.74, ("qkv", 256): 7.34,
    ("o", 1): 8.08, ("o", 64): 8.22, ("o", 256): 8.46,
    ("gate_up", 1): 6.18, ("gate_up", 64): 6.89, ("gate_up", 256): 7.97,
    ("down", 1): 9.73, ("down", 64): 10.04, ("down", 256): 10.53,
}  # fmt: skip


def main() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return
    torch.manual_seed(0)
    dtype = torch.bfloat16
    per_m: dict[int, dict[str, float]] = {}
    for name, (k, shards) in SHAPES.items():
        n = sum(shards)
        weight = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        a = torch.randn(SLOTS, len(shards) * RANK, k, device="cuda", dtype=dtype) * k**-0.5
        b = torch.randn(SLOTS, n, RANK, device="cuda", dtype=dtype) * 0.01
        for m in (1, 64, 256, 2048, 8192):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            y = F.linear(x, weight)
            if m >= 2048:  # eight prompts, one per adapter
                seq_slots, lens = list(range(SLOTS)), [m // SLOTS] * SLOTS
            else:
                seq_slots, lens = [i % SLOTS for i in range(m)], [1] * m
            tokens, blocks = plan_lora_blocks(seq_slots, lens, SLOTS, m)
            bt = torch.tensor(tokens, dtype=torch.int32, device="cuda")
            bs = torch.tensor(blocks, dtype=torch.int32, device="cuda")
            launch = plan_lora_launch(m, SLOTS, k, shards, RANK, x.element_size())
            gemm_us = graph_time_us(functools.partial(F.linear, x, weight))
            lora_us = graph_time_us(functools.partial(lora_add, x, y, a, b, bt, bs, shards))
            forced = {}
            for path in ("fused", "split"):
                call = functools.partial(lora_add, x, y, a, b, bt, bs, shards, path=path)
                forced[f"{path}_us"] = round(graph_time_us(call), 2)
            used = min(m, SLOTS)
            moved = used * (a[0].numel() + b[0].numel()) * 2 + m * (k + 2 * n) * 2
            row = {"layer": name, "m": m, "k": k, "n": n, "rank": RANK, "slots_used": used}
            row |= {"path": launch.path, "launches": 1 if launch.path == "fused" else 2, "splits": launch.splits}
            row["tiles"] = launch.tiles
            row |= {"gemm_us": round(gemm_us, 2), "lora_us": round(lora_us, 2), **forced}
            row["run52_lora_us"] = RUN52_US.get((name, m))
            row["lora_over_gemm"] = round(lora_us / gemm_us, 3)
            row["lora_tb_s"] = round(moved / lora_us / 1e6, 2)
            row["lora_pct_of_copy_bw"] = round(100 * row["lora_tb_s"] / COPY_TB_S, 1)
            print(json.dumps(row), flush=True)
            total = per_m.setdefault(m, {"lora_us": 0.0, "gemm_us": 0.0, "launches": 0, "run52_lora_us": 0.0})
            total["lora_us"] += lora_us
            total["gemm_us"] += gemm_us
            total["launches"] += row["launches"]
            total["run52_lora_us"] += RUN52_US.get((name, m), float("nan"))
    for m, total in per_m.items():
        print(
            json.dumps({"summary": "per decoder layer (4 sites)", "m": m} | {k: round(v, 2) for k, v in total.items()})
        )


if __name__ == "__main__":
    main()
