"""The layouts GGUF files are kept in (quantization/gguf_types.py), through the quantized layer's own paths
(`QuantLinear` with its kernels on), against bf16 cuBLAS, per layer shape of Qwen3-8B and per decode-sized
token count: Q4_K (int4, groups of 32, float32 scales and mins), the same with float16 scales (what exactness
costs), Q6_K (int8, groups of 16, zero points, float32), Q4_K beside Q6_K in one packed layer (int8, 16, float32
mins) and Q8_0 (int8, 32, zero points, float16). GPU time per call from CUDA-graph replays, weight copies
rotated past L2; each row with its bytes and percent of the copy bandwidth (`COPY_TB_S`, ../shared/PERF.md).

Device machine: python3 bench/kernels/bench_gguf_layouts.py [--m 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from asyncllm.quantization.linear import QuantLinear
from asyncllm.quantization.scheme import CheckpointFormat, QuantScheme
from asyncllm.worker.gemm_layout import graph_time_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # Qwen3-8B
COPY_TB_S = 4.25
LAYOUTS = {  # name: (bits, group, zero points, scale dtype)
    "q4_k": (4, 32, False, "float32"),
    "q4_k_f16_scales": (4, 32, False, "float16"),
    "q6_k": (8, 16, True, "float32"),
    "q4_k+q6_k": (8, 16, False, "float32"),
    "q8_0": (8, 32, True, "float16"),
}


def _layer(n: int, k: int, layout: tuple[int, int, bool, str]) -> QuantLinear:
    bits, group, zeros, dtype = layout
    scheme = QuantScheme("gguf", CheckpointFormat.GGUF, fp8=False, bits=bits, group_size=group, zero_point=zeros,
                         mins=not zeros, scale_dtype=dtype)  # fmt: skip
    layer = QuantLinear(k, n, scheme, bias=None, device=torch.device("cuda"))
    layer.fill_random(torch.Generator("cuda").manual_seed(0), 0.02)
    layer.enable_fused_kernels()
    return layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(8, (1 << 30) // (n * k * 2)))
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for layout_name, layout in LAYOUTS.items():
            layers = [_layer(n, k, layout) for _ in range(copies)]
            nbytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                with torch.no_grad():
                    us = graph_time_us([lambda layer=layer, x=x: layer(x) for layer in layers])
                    bf16 = graph_time_us([lambda w=w, x=x: F.linear(x, w) for w in dense])
                row = {"layer": name, "layout": layout_name, "m": m, "n": n, "k": k, "us": round(us, 2),
                       "bf16_us": round(bf16, 2), "bits_per_weight": round(8 * nbytes / (n * k), 2),
                       "pct_of_copy_bw": round(100 * nbytes / (us * 1e-6) / (COPY_TB_S * 1e12), 1),
                       "speedup_vs_bf16": round(bf16 / us, 2)}  # fmt: skip
                print(json.dumps(row), flush=True)
            del layers


if __name__ == "__main__":
    main()
