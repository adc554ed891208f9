"""Compiles the quantized GEMM and dequantization kernels for Hopper (sm_90) without a GPU: Triton's compiler
and the ptxas it ships, in a process without TRITON_INTERPRET. Catches what the interpreter accepts and the
compiler does not (a kernel reading a plain module global, a shape that is not a power of two, an unsupported
conversion). Run by tests/kernels/test_quant_matmul.py; prints one line per variant, "ok" or the error."""

from __future__ import annotations

import os
import sys

assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the real Triton, not the interpreter"

import triton  # noqa: E402
from asyncllm.kernels import quant_matmul as qm  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {4: ("*i32", "*fp16"), 8: ("*i32", "*fp16"), 0: ("*fp8e4nv", "*fp32")}  # codes, scales
GROUPS = {0: 4096, 1: 128, 2: 32, 3: 40}  # a group size that takes each MODE at BLOCK_K 128 or 64


def gemm(
    bits: int, mode: int, zeros: bool, mins: bool, partial: bool, blocks: tuple[int, int, int],
    group: int | None = None, scales: str | None = None,
) -> None:  # fmt: skip
    codes, scales = POINTERS[bits][0], scales or POINTERS[bits][1]
    signature = {"x_ptr": "*bf16", "w_ptr": codes, "s_ptr": scales, "z_ptr": "*u8", "m_ptr": scales,
                 "b_ptr": "*bf16", "out_ptr": "*fp32" if partial else "*bf16"}  # fmt: skip
    signature |= {name: "i32" for name in ("M", "N", "K", "split_k", "stride_xm", "stride_wn", "stride_sn")}
    signature |= {name: "i32" for name in ("stride_zn", "stride_mn", "stride_om", "stride_os")}
    consts = dict(BITS=bits, GROUP=group or GROUPS[mode], MODE=mode, HAS_ZEROS=zeros, HAS_MINS=mins, HAS_BIAS=True,
                  PARTIAL=partial, DOT_PRECISION="tf32")  # fmt: skip
    consts |= dict(BLOCK_M=blocks[0], BLOCK_N=blocks[1], BLOCK_K=blocks[2])
    signature |= {name: "constexpr" for name in consts}
    source = ASTSource(fn=qm._quant_matmul_kernel, signature=signature, constexprs=consts)
    triton.compile(source, target=TARGET, options={"num_warps": 4, "num_stages": 3})


def dequantize(bits: int) -> None:
    codes, scales = POINTERS[bits]
    signature = {"w_ptr": codes, "s_ptr": scales, "z_ptr": "*u8", "m_ptr": scales, "out_ptr": "*bf16"}
    signature |= {name: "i32" for name in ("N", "K", "stride_wn", "stride_sn", "stride_zn", "stride_mn", "stride_on")}
    consts = dict(BITS=bits, GROUP=128, HAS_ZEROS=bits != 0, HAS_MINS=False, BLOCK_N=32, BLOCK_K=128)
    signature |= {name: "constexpr" for name in consts}
    triton.compile(ASTSource(fn=qm._dequantize_kernel, signature=signature, constexprs=consts), target=TARGET)


VARIANTS = [
    ("int4 TILE zeros decode", lambda: gemm(4, 1, True, False, True, (16, 64, 128))),
    ("int4 GROUPS mins", lambda: gemm(4, 2, False, True, False, (16, 64, 128))),
    ("int4 ROW mins prefill", lambda: gemm(4, 0, False, True, False, (64, 128, 64))),
    ("int8 GATHER zeros", lambda: gemm(8, 3, True, False, False, (32, 64, 128))),
    ("int8 TILE", lambda: gemm(8, 1, False, False, True, (64, 128, 64))),
    ("e4m3 ROW decode", lambda: gemm(0, 0, False, False, True, (16, 64, 128))),
    ("e4m3 TILE block scales", lambda: gemm(0, 1, False, False, False, (64, 64, 64))),
    ("e4m3 GROUPS", lambda: gemm(0, 2, False, False, False, (16, 64, 128))),
    # GGUF's K-quants (model_loader/gguf/repack.py): float32 scales, Q6_K's groups of 16, 8-bit codes with mins
    ("int8 GROUPS zeros g16 f32 scales", lambda: gemm(8, 2, True, False, True, (16, 64, 128), 16, "*fp32")),
    ("int8 GROUPS mins g16 f32 scales", lambda: gemm(8, 2, False, True, False, (64, 128, 64), 16, "*fp32")),
    ("int4 GROUPS mins f32 scales", lambda: gemm(4, 2, False, True, True, (16, 64, 128), 32, "*fp32")),
    ("dequantize int4", lambda: dequantize(4)),
    ("dequantize e4m3", lambda: dequantize(0)),
]

if __name__ == "__main__":
    failed = 0
    for name, compile_variant in VARIANTS:
        try:
            compile_variant()
            print(f"ok {name}", flush=True)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1 if failed else 0)
