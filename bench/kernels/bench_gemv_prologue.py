"""The GEMV with its prologue folded in (kernels/quant_matmul_gemv.py: `rms_norm_gemv`, `silu_mul_gemv`) against
the two launches it replaces, at one token row in bf16, for Qwen3-0.6B's and Qwen3-8B's pairs: the residual add +
RMSNorm before qkv and gate_up, SiLU-and-mul before down. Each pair: the fused GEMV; the op's own kernel
(kernels/rms_norm.py, kernels/silu_mul.py) then cuBLAS (the better of both weight layouts) or then the plain
GEMV; and each of those with PDL (kernels/pdl.py; Hopper or newer). GPU microseconds per pair from replays of a
CUDA graph (worker/gemm_layout.graph_time_us), several weight copies rotated so none is read from L2; the fused
output is first checked against gemv_prologue_ref at bf16 tolerance.

Prints one JSON line per pair. Device machine: python3 bench/kernels/bench_gemv_prologue.py [--shapes qwen3-0.6b
qwen3-8b] [--no-pdl]   (~20 s)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from asyncllm.kernels import quant_matmul_gemv as gemv
from asyncllm.kernels.gemv_prologue_ref import rms_norm_gemv_ref, silu_mul_gemv_ref
from asyncllm.kernels.rms_norm import rms_norm
from asyncllm.kernels.silu_mul import silu_and_mul
from asyncllm.worker.gemm_layout import graph_time_us

PAIRS = {  # pair: (prologue, N, K)
    "qwen3-0.6b": {"norm>qkv": ("norm", 4096, 1024), "norm>gate_up": ("norm", 6144, 1024),
                   "silu>down": ("silu", 1024, 3072)},
    "qwen3-8b": {"norm>qkv": ("norm", 6144, 4096), "norm>gate_up": ("norm", 24576, 4096),
                 "silu>down": ("silu", 4096, 12288)},
}  # fmt: skip
EPS = 1e-6
COPIES_BYTES = 200 << 20  # weight copies rotated: four times the H200's 50 MB L2


def _us(calls: list[Callable[[], object]]) -> float:
    return round(graph_time_us(calls, calls=max(10, len(calls))), 2)


def pair_times(prologue: str, n: int, k: int, pdl: bool) -> dict[str, float]:
    dtype = torch.bfloat16
    copies = max(1, min(24, COPIES_BYTES // (2 * n * k)))
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]
    transposed = [w.t().contiguous().t() for w in weights]
    locks = gemv.gemv_locks(n, 1, torch.device("cuda"))
    tol = 2e-2
    if prologue == "norm":
        x, residual = torch.randn(1, k, device="cuda", dtype=dtype), torch.randn(1, k, device="cuda", dtype=dtype)
        nw = torch.rand(k, device="cuda", dtype=dtype) + 0.5
        got, h = gemv.rms_norm_gemv(x, nw, EPS, weights[0], residual=residual, locks=locks)
        want, want_h = rms_norm_gemv_ref(x, nw, EPS, weights[0], residual=residual)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        torch.testing.assert_close(h, want_h, atol=0, rtol=0)
        normed = torch.empty_like(x)
        op = partial(rms_norm, x, nw, EPS, residual=residual.clone(), out=normed, pdl=pdl)
        fused = [partial(gemv.rms_norm_gemv, x, nw, EPS, w, residual=residual, locks=locks, pdl=pdl) for w in weights]
    else:
        x = torch.randn(1, 2 * k, device="cuda", dtype=dtype)
        torch.testing.assert_close(gemv.silu_mul_gemv(x, weights[0], locks=locks), silu_mul_gemv_ref(x, weights[0]),
                                   atol=tol, rtol=tol)  # fmt: skip
        normed = silu_and_mul(x)
        op = partial(silu_and_mul, x, out=normed)
        fused = [partial(gemv.silu_mul_gemv, x, w, locks=locks, pdl=pdl) for w in weights]

    def then(second: Callable[[torch.Tensor], object]) -> Callable[[], object]:
        return lambda: (op(), second(normed))

    cublas = min(_us([then(lambda t, w=w: F.linear(t, w)) for w in ws]) for ws in (weights, transposed))
    plain = _us([then(partial(gemv.linear_gemv, weight=w, locks=locks, pdl=pdl)) for w in weights])
    return {"fused_us": _us(fused), "op_then_cublas_us": cublas, "op_then_gemv_us": plain, "op_us": _us([op])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--no-pdl", action="store_true", help="skip the PDL rows")
    args = ap.parse_args()
    pdl_modes = (False,) if args.no_pdl or torch.cuda.get_device_capability()[0] < 9 else (False, True)
    for shape in args.shapes:
        for name, (prologue, n, k) in PAIRS[shape].items():
            for pdl in pdl_modes:
                row = {"shape": shape, "pair": name, "n": n, "k": k, "pdl": pdl, **pair_times(prologue, n, k, pdl)}
                row["fused_saves_us"] = round(
                    min(row["op_then_cublas_us"], row["op_then_gemv_us"]) - row["fused_us"], 2
                )
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
