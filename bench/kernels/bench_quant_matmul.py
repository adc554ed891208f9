"""The quantized GEMM paths against bf16 cuBLAS, per layer shape of Qwen3-0.6B and Qwen3-8B and per token
count: the one-launch GEMV ("gemv", up to GEMV_MAX_M tokens), the Triton weight-only GEMM ("triton"), both on
int4 AWQ-style g128 with zero points and e4m3 per channel; dequantize + cuBLAS; W8A8 `torch._scaled_mm`
(Hopper); and F.linear on a bf16 weight. GPU time per call from replays of a CUDA graph (graph replay is how
decode runs), several weight copies rotated so none is read from L2; each row with every path's microseconds
per call, TB/s (the bytes the path must read: the quantized weight with its scales, or the bf16 weight for
cuBLAS) and percent of the copy bandwidth (`COPY_TB_S`, ../shared/PERF.md). A last line per code type names
the fastest path by token count: where quantization/linear.py's GEMV_MAX_TOKENS, DEQUANT_MIN_TOKENS and
W8A8_MIN_TOKENS should sit.

Device machine: python3 bench/kernels/bench_quant_matmul.py [--shapes qwen3-0.6b qwen3-8b] [--m 1 2 4 ...]
(decode sizes only, the GEMV against the GEMM and bf16: --m 1 4 16)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncllm.kernels import quant_matmul as qm
from asyncllm.kernels import quant_matmul_gemv as gemv
from asyncllm.kernels.fp8_scaled_mm import fp8_w8a8_matmul, supports_w8a8
from asyncllm.kernels.quant_matmul_ref import pack_codes, quantize_fp8_rows
from asyncllm.worker.gemm_layout import graph_time_us

SHAPES = {  # layer: (N, K)
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
}
COPY_TB_S = 4.25
GROUP = 128
GEMV_MAX_M = 16  # the GEMV is timed up to this many tokens (the layer takes it up to GEMV_MAX_TOKENS)


def _int4(n: int, k: int) -> dict[str, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k), device="cuda")
    return dict(
        qweight=pack_codes(codes, 4),
        scales=torch.rand(n, k // GROUP, device="cuda", dtype=torch.bfloat16) * 0.01,
        qzeros=torch.randint(0, 16, (n, k // GROUP), device="cuda", dtype=torch.uint8),
    )


def _fp8(n: int, k: int) -> dict[str, torch.Tensor]:
    qweight, scales = quantize_fp8_rows(torch.randn(n, k, device="cuda") * 0.02)
    return dict(qweight=qweight, scales=scales, scale_row=scales.reshape(1, -1).contiguous())


def _nbytes(w: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for key, t in w.items() if key not in ("scale_row", "locks"))


def paths(kind: str, weights: list[dict[str, torch.Tensor]], x: torch.Tensor) -> dict[str, list[Callable[[], object]]]:
    """Path name -> one call per weight copy."""
    k = x.shape[1]
    bits, group = (4, GROUP) if kind == "int4" else (8, k)
    out: dict[str, list[Callable[[], object]]] = {
        "triton": [
            lambda w=w: qm.quant_matmul(x, w["qweight"], w["scales"], w.get("qzeros"), bits=bits, group_size=group)
            for w in weights
        ],
        "gemv": [
            lambda w=w: gemv.quant_gemv(
                x, w["qweight"], w["scales"], w.get("qzeros"), bits=bits, group_size=group, locks=w["locks"]
            )
            for w in weights
        ]
        if x.shape[0] <= GEMV_MAX_M
        else [],
        "dequant_cublas": [
            lambda w=w: F.linear(
                x,
                qm.dequantize(w["qweight"], w["scales"], w.get("qzeros"), bits=bits, group_size=group, dtype=x.dtype),
            )
            for w in weights
        ],
    }
    if kind == "fp8" and supports_w8a8(x.device):
        out["w8a8"] = [lambda w=w: fp8_w8a8_matmul(x, w["qweight"], w["scale_row"]) for w in weights]
    return {name: calls for name, calls in out.items() if calls}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return
    torch.manual_seed(0)
    fastest: dict[str, dict[int, dict[str, float]]] = {"int4": defaultdict(dict), "fp8": defaultdict(dict)}
    for shape in args.shapes:
        for layer, (n, k) in SHAPES[shape].items():
            copies = max(2, min(8, (1 << 30) // (n * k * 2)))  # more than L2 holds, at most 1 GiB of bf16 weights
            dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for kind, make in (("int4", _int4), ("fp8", _fp8)):
                weights = [make(n, k) | {"locks": gemv.gemv_locks(n, GEMV_MAX_M, torch.device("cuda"))}
                           for _ in range(copies)]  # fmt: skip
                nbytes = _nbytes(weights[0])
                for m in args.m:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    row: dict[str, object] = {"shape": shape, "layer": layer, "codes": kind, "m": m, "n": n, "k": k}
                    times = {name: graph_time_us(calls) for name, calls in paths(kind, weights, x).items()}
                    times["bf16_cublas"] = graph_time_us([lambda w=w, x=x: F.linear(x, w) for w in dense])
                    for name, us in times.items():
                        moved = n * k * 2 if name == "bf16_cublas" else nbytes
                        row[f"{name}_us"] = round(us, 2)
                        row[f"{name}_tb_s"] = round(moved / (us * 1e-6) / 1e12, 3)
                        row[f"{name}_pct"] = round(100 * moved / (us * 1e-6) / (COPY_TB_S * 1e12), 1)
                    best = min((us, name) for name, us in times.items() if name != "bf16_cublas")
                    row["best"] = best[1]
                    row["best_pct_of_copy_bw"] = round(100 * nbytes / (best[0] * 1e-6) / (COPY_TB_S * 1e12), 1)
                    row["speedup_vs_bf16"] = round(times["bf16_cublas"] / best[0], 2)
                    print(json.dumps(row), flush=True)
                    for name, us in times.items():
                        fastest[kind][m][name] = fastest[kind][m].get(name, 0.0) + us
                del weights
    for kind, by_m in fastest.items():
        winners = {m: min((us, name) for name, us in t.items() if name != "bf16_cublas")[1] for m, t in by_m.items()}
        print(json.dumps({"summary": "bench_quant_matmul", "codes": kind, "fastest_by_tokens": winners}), flush=True)


if __name__ == "__main__":
    main()
