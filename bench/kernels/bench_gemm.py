"""How fast cuBLAS reads the decode-step weights at small batch: the GEMMs stay cuBLAS, so this measures
which call shape serves them best. Qwen3-0.6B projections (qkv 1024->4096, o 2048->1024, gate_up
1024->6144, down 3072->1024, lm_head 1024->151936), bf16, M = 1..256 rows: F.linear on the [out, in] weight
(what the model does), matmul on a pre-transposed [in, out] copy, and torch.mv for M = 1. GPU time per call
from CUDA events over replays of a CUDA graph of 20 calls (graph replay is how decode runs), and the
weight-read bandwidth against the copy bandwidth (`COPY_TB_S`, ../shared/PERF.md). Prints one JSON line per
(layer, M)."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from asyncllm.worker.gemm_layout import graph_time_us  # the same timing the start-up tuner uses

SHAPES = {
    "qkv": (1024, 4096),
    "o": (2048, 1024),
    "gate_up": (1024, 6144),
    "down": (3072, 1024),
    "lm_head": (1024, 151936),
}
COPY_TB_S = 4.25


def main() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return
    torch.manual_seed(0)
    for name, (k, n) in SHAPES.items():
        # Several weight copies rotated through, so no call reads a weight another left in L2.
        copies = 4 if n < 100_000 else 1
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        transposed = [w.t().contiguous() for w in weights]
        for m in (1, 8, 64, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row: dict[str, object] = {"layer": name, "m": m, "k": k, "n": n}
            row["linear_us"] = round(graph_time_us([lambda w=w, x=x: F.linear(x, w) for w in weights]), 2)
            row["matmul_t_us"] = round(graph_time_us([lambda w=w, x=x: torch.matmul(x, w) for w in transposed]), 2)
            if m == 1:
                row["mv_us"] = round(graph_time_us([lambda w=w, x=x: torch.mv(w, x[0]) for w in weights]), 2)
            best = min(float(v) for key, v in row.items() if key.endswith("_us"))  # type: ignore[arg-type]
            row["best_tb_s"] = round(n * k * 2 / best / 1e6, 2)
            row["best_pct_of_copy_bw"] = round(100 * row["best_tb_s"] / COPY_TB_S, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
