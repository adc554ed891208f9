"""Compiles the quantized GEMM, GEMV (its quantized and 16-bit modes, every tile the GEMV sweep may pick) and
dequantization kernels for Hopper (sm_90) without a GPU: Triton's compiler up to PTX
(tests/kernels/hopper_target.py), in a process without TRITON_INTERPRET. Catches what the interpreter accepts
and the compiler does not (a kernel reading a plain module global, a shape that is not a power of two, an
unsupported conversion). Run by tests/kernels/test_quant_matmul.py; prints one line per variant, "ok" or the
error."""

from __future__ import annotations

import os
import sys
from functools import partial

assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the real Triton, not the interpreter"

from hopper_target import compile_for_hopper, report  # noqa: E402  (beside this script)
from triton.compiler import ASTSource  # noqa: E402

from asyncllm.kernels import gemv_plan, rms_norm  # noqa: E402
from asyncllm.kernels import qk_norm_rope_kv as qk  # noqa: E402
from asyncllm.kernels import quant_matmul as qm  # noqa: E402
from asyncllm.kernels import quant_matmul_gemv as gemv  # noqa: E402

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
    compile_for_hopper(source, num_warps=4, num_stages=3)


def dequantize(bits: int) -> None:
    codes, scales = POINTERS[bits]
    signature = {"w_ptr": codes, "s_ptr": scales, "z_ptr": "*u8", "m_ptr": scales, "out_ptr": "*bf16"}
    signature |= {name: "i32" for name in ("N", "K", "stride_wn", "stride_sn", "stride_zn", "stride_mn", "stride_on")}
    consts = dict(BITS=bits, GROUP=128, HAS_ZEROS=bits != 0, HAS_MINS=False, BLOCK_N=32, BLOCK_K=128)
    signature |= {name: "constexpr" for name in consts}
    compile_for_hopper(ASTSource(fn=qm._dequantize_kernel, signature=signature, constexprs=consts))


def rms_norm_pdl(residual: bool) -> None:
    """RMSNorm (kernels/rms_norm.py) launched as a programmatic dependent: Qwen3-0.6B's hidden size in bf16."""
    signature = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "num_rows": "i32",
                 "eps": "fp32", "stride_x": "i32", "stride_res": "i32", "stride_out": "i32"}  # fmt: skip
    block_h, rows, warps = rms_norm.launch_config(1024)
    consts = dict(HIDDEN=1024, BLOCK_H=block_h, ROWS=rows, HAS_RESIDUAL=residual, UNIT_OFFSET=False, PDL=True)
    signature |= {name: "constexpr" for name in consts}
    source = ASTSource(fn=rms_norm._rms_norm_kernel, signature=signature, constexprs=consts)
    compile_for_hopper(source, num_warps=warps, launch_pdl=True)


def qk_norm_rope_kv_pdl() -> None:
    """The q/k norm + rotary + KV write (kernels/qk_norm_rope_kv.py) launched as a programmatic dependent:
    Qwen3-0.6B's 16 query heads over 8 KV heads, bf16, a bf16 cache."""
    signature = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_w_ptr": "*bf16",
                 "k_w_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
                 "q_out_ptr": "*bf16", "k_scale_ptr": "*bf16", "v_scale_ptr": "*bf16", "eps": "fp32"}  # fmt: skip
    strides = ("stride_qkv", "stride_cos", "stride_sin", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
               "stride_vt", "stride_vh", "stride_qo_t", "stride_qo_h")  # fmt: skip
    signature |= {name: "i32" for name in strides}
    consts = dict(NUM_HEADS=16, NUM_KV_HEADS=8, GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_R=4, BLOCK_HALF=64,
                  HAS_NORM=True, UNIT_OFFSET=False, KV_FP8=False, PDL=True)  # fmt: skip
    signature |= {name: "constexpr" for name in consts}
    source = ASTSource(fn=qk._qk_norm_rope_kv_kernel, signature=signature, constexprs=consts)
    compile_for_hopper(source, num_warps=2, launch_pdl=True, enable_fp_fusion=False)


def gemv_kernel(
    bits: int, group: int, zeros: bool, mins: bool, split: int, act: str, even_k: bool = True, scales: str = "",
    config: gemv_plan.GemvConfig = gemv_plan.DEFAULT_CONFIG, prologue: int = 0, pdl: bool = False,
    prefetch: bool = True,
) -> None:  # fmt: skip
    """The GEMV at the tile shape its launcher picks for `group` over K = 4096 (`gemv_plan`); bits 16: plain
    16-bit weights of the activations' type, no scales. `prologue`: gemv_prologue.py's mode."""
    plain = bits == gemv_plan.FLOAT16
    codes, default_scales = (act, act) if plain else POINTERS[bits]
    scales = scales or default_scales
    plan = gemv_plan.gemv_plan(1, 4096, 4096, bits, group, 132, split, config)
    assert plan is not None, group
    signature = {"x_ptr": act, "w_ptr": codes, "s_ptr": scales, "z_ptr": "*u8", "m_ptr": scales, "b_ptr": act,
                 "part_ptr": "*fp32", "lock_ptr": "*i32", "out_ptr": act, "a_ptr": act, "nw_ptr": act,
                 "h_ptr": act, "eps": "fp32"}  # fmt: skip
    signature |= {name: "i32" for name in ("N", "K", "GROUPS", "tiles_per_split", "split", "stride_xm")}
    signature |= {name: "i32" for name in ("stride_wn", "stride_sn", "stride_zn", "stride_mn", "stride_om")}
    signature |= {name: "i32" for name in ("stride_am", "stride_hm")}
    per = gemv_plan.codes_per_unit(bits)
    row_group = gemv_plan.ROW_GROUP if group >= 4096 else group  # as the launcher passes it
    consts = dict(BITS=bits if per > 1 else 0, CODES=per, GROUP=row_group, G=plan.groups, GW=plan.group_words,
                  HAS_SCALES=not plain, HAS_ZEROS=zeros, HAS_MINS=mins, HAS_BIAS=True, EVEN_K=even_k,
                  BLOCK_N=config.block_n, FOLD=config.fold_offsets and per > 1, PROLOGUE=prologue,
                  PDL=pdl, PREFETCH=pdl and prefetch)  # fmt: skip
    signature |= {name: "constexpr" for name in consts}
    source = ASTSource(fn=gemv._gemv_kernel, signature=signature, constexprs=consts)
    compile_for_hopper(source, num_warps=config.num_warps, launch_pdl=pdl)


FOLDED = gemv_plan.GemvConfig(fold_offsets=True)
SWEEP_KINDS = {  # gemv_kernel's arguments for each kind bench/kernels/sweep_gemv.py sweeps
    "int4 g128": (4, 128, True, False, 2, "*bf16"),
    "e4m3 channel": (0, 4096, False, False, 2, "*bf16"),
    "bf16": (gemv_plan.FLOAT16, 4096, False, False, 2, "*bf16"),
}


def sweep_tile(kind: str, block_n: int, num_warps: int, row_bytes: int, fold: bool) -> None:
    config = gemv_plan.GemvConfig(block_n=block_n, num_warps=num_warps, row_bytes=row_bytes, fold_offsets=fold)
    gemv_kernel(*SWEEP_KINDS[kind], config=config)


# Every tile the sweep may pick, for each kind it sweeps (int4 with its offsets folded or not)
SWEEP_VARIANTS = [
    (
        f"gemv sweep {kind} block_n {bn} warps {w} rows {rb}B{' folded' if fold else ''}",
        partial(sweep_tile, kind, bn, w, rb, fold),
    )
    for kind in SWEEP_KINDS
    for bn, w, rb in gemv_plan.CANDIDATE_TILES
    for fold in ((False, True) if kind == "int4 g128" else (False,))
]

PROLOGUE_CASES = (  # name, split, even K, config, PDL
    ("split", 4, True, gemv_plan.DEFAULT_CONFIG, False),
    ("odd K", 1, False, gemv_plan.GemvConfig(128, 4, 128, 4, 32), False),
    ("split pdl", 2, True, gemv_plan.GemvConfig(64, 4, 256, 16, 32), True),
)
PROLOGUE_VARIANTS = [
    (f"gemv bf16 prologue {mode} {name}", partial(gemv_kernel, gemv_plan.FLOAT16, 4096, False, False, split, "*bf16",
                                                  even_k, config=config, prologue=mode, pdl=pdl))
    for mode in (1, 2, 3)
    for name, split, even_k, config, pdl in PROLOGUE_CASES
]  # fmt: skip

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
    ("gemv int4 g128 zeros split bf16", lambda: gemv_kernel(4, 128, True, False, 4, "*bf16")),
    ("gemv int4 g128 zeros fp16 odd K", lambda: gemv_kernel(4, 128, True, False, 1, "*fp16", even_k=False)),
    ("gemv int4 g32 mins (Q4_1) bf16", lambda: gemv_kernel(4, 32, False, True, 2, "*bf16")),
    ("gemv int4 g32 zeros (Q4_0) fp16", lambda: gemv_kernel(4, 32, True, False, 1, "*fp16")),
    ("gemv int8 g32 zeros (Q8_0) bf16", lambda: gemv_kernel(8, 32, True, False, 3, "*bf16")),
    ("gemv int8 g128 sym fp16 split", lambda: gemv_kernel(8, 128, False, False, 4, "*fp16", even_k=False)),
    ("gemv e4m3 channel bf16 split", lambda: gemv_kernel(0, 4096, False, False, 4, "*bf16")),
    ("gemv e4m3 block 128 fp16", lambda: gemv_kernel(0, 128, False, False, 1, "*fp16", even_k=False)),
    # GGUF's K-quants through the GEMV: float32 scales; Q6_K's groups of 16 (8-bit codes), Q5_K's mins
    ("gemv int8 g16 zeros f32 scales (Q6_K)", lambda: gemv_kernel(8, 16, True, False, 2, "*bf16", scales="*fp32")),
    ("gemv int4 g32 mins f32 scales (Q4_K)", lambda: gemv_kernel(4, 32, False, True, 1, "*fp16", scales="*fp32")),
    ("gemv int8 g32 mins f32 scales (Q5_K)", lambda: gemv_kernel(8, 32, False, True, 3, "*bf16", scales="*fp32")),
    # integer codes with their offsets folded (GemvConfig.fold_offsets): int8 zeros, mins, an odd K
    ("gemv int8 g32 zeros (Q8_0) folded", lambda: gemv_kernel(8, 32, True, False, 3, "*bf16", config=FOLDED)),
    (
        "gemv int4 g32 mins (Q4_1) folded odd K",
        lambda: gemv_kernel(4, 32, False, True, 1, "*fp16", False, config=FOLDED),
    ),
    # plain 16-bit weights (dense layers at one token row): no scales; split and unsplit, an odd K
    ("gemv bf16 split", lambda: gemv_kernel(gemv_plan.FLOAT16, 4096, False, False, 4, "*bf16")),
    ("gemv fp16 odd K", lambda: gemv_kernel(gemv_plan.FLOAT16, 4096, False, False, 1, "*fp16", even_k=False)),
    # prologues folded into the 16-bit GEMV (gemv_prologue.py): RMSNorm, add + RMSNorm, SiLU-and-mul; split,
    # unsplit, an odd K, the 0.6B's tuned qkv tile; and launched as a programmatic dependent (PDL)
    *PROLOGUE_VARIANTS,
    ("rms_norm pdl", lambda: rms_norm_pdl(False)),
    ("rms_norm residual pdl", lambda: rms_norm_pdl(True)),
    ("qk_norm_rope_kv pdl", qk_norm_rope_kv_pdl),
    ("gemv bf16 pdl no prologue", lambda: gemv_kernel(gemv_plan.FLOAT16, 4096, False, False, 4, "*bf16", pdl=True)),
    (
        "gemv bf16 pdl no prefetch",  # the layers whose weight passes half the L2 (Linear.use_pdl)
        lambda: gemv_kernel(gemv_plan.FLOAT16, 4096, False, False, 4, "*bf16", pdl=True, prefetch=False),
    ),
    *SWEEP_VARIANTS,
]

if __name__ == "__main__":
    sys.exit(report(VARIANTS))
