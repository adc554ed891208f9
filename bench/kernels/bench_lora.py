"""The batched LoRA kernels (kernels/lora.py) against the base layer's GEMM they ride on: Qwen3-0.6B's packed
projections (qkv 1024->2048+1024+1024 in 3 shards, o 2048->1024, gate_up 1024->2x3072, down 3072->1024), bf16,
rank 16, 8 adapter slots; M = 1, 64, 256 rows (decode batches, one adapter per row, round robin) and 2048 (a
prefill chunk of 8 adapters' prompts). GPU time per call from CUDA events over replays of a CUDA graph (how
decode runs), for F.linear alone and for `lora_add` (shrink + expand) alone; `lora_over_gemm` is what LoRA adds
to the layer. Also the bytes the kernels must move (each used slot's A and B, the rows read and the output
read and written) as a bandwidth against the copy bandwidth (`COPY_TB_S`, ../shared/PERF.md). One JSON line
per (layer, M)."""

from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F
from asyncllm.kernels.lora import lora_add
from asyncllm.kernels.lora_plan import plan_lora_blocks

from asyncllm.worker.gemm_layout import graph_time_us

SHAPES = {  # layer -> (in, output shards)
    "qkv": (1024, (2048, 1024, 1024)),
    "o": (2048, (1024,)),
    "gate_up": (1024, (3072, 3072)),
    "down": (3072, (1024,)),
}
RANK, SLOTS = 16, 8
COPY_TB_S = 4.25


def main() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return
    torch.manual_seed(0)
    dtype = torch.bfloat16
    for name, (k, shards) in SHAPES.items():
        n = sum(shards)
        weight = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        a = torch.randn(SLOTS, len(shards) * RANK, k, device="cuda", dtype=dtype) * k**-0.5
        b = torch.randn(SLOTS, n, RANK, device="cuda", dtype=dtype) * 0.01
        for m in (1, 64, 256, 2048):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            y = F.linear(x, weight)
            if m == 2048:  # eight prompts of 256 tokens, one per adapter
                seq_slots, lens = list(range(SLOTS)), [m // SLOTS] * SLOTS
            else:
                seq_slots, lens = [i % SLOTS for i in range(m)], [1] * m
            tokens, blocks = plan_lora_blocks(seq_slots, lens, SLOTS, m)
            bt = torch.tensor(tokens, dtype=torch.int32, device="cuda")
            bs = torch.tensor(blocks, dtype=torch.int32, device="cuda")
            gemm_us = graph_time_us(functools.partial(F.linear, x, weight))
            lora_us = graph_time_us(functools.partial(lora_add, x, y, a, b, bt, bs, shards))
            used = min(m, SLOTS)
            moved = used * (a[0].numel() + b[0].numel()) * 2 + m * (k + 2 * n) * 2
            row = {"layer": name, "m": m, "k": k, "n": n, "rank": RANK, "slots_used": used}
            row |= {"gemm_us": round(gemm_us, 2), "lora_us": round(lora_us, 2)}
            row["lora_over_gemm"] = round(lora_us / gemm_us, 3)
            row["lora_tb_s"] = round(moved / lora_us / 1e6, 2)
            row["lora_pct_of_copy_bw"] = round(100 * row["lora_tb_s"] / COPY_TB_S, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
