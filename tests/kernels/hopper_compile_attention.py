"""Compiles the paged attention kernels (kernels/paged_attention_kernels.py: split-KV decode, its reduction, the
varlen prefill; the split kernel with the reduce folded in (paged_attention_fold.py); both decode kernels in
cascade form too, with kernels/paged_attention_cascade.py's prefix kernel) and the fused q/k norm + rotary +
KV write (kernels/qk_norm_rope_kv.py) for Hopper (sm_90) without a GPU: Triton's compiler up to PTX
(tests/kernels/hopper_target.py), in a process without TRITON_INTERPRET, at the constants their launchers pick
for head_dim 128 (Qwen3's): over an FP8 (e4m3) cache, bf16 queries global and sliding and float32 ones (the
write also in Gemma's float16 form); over a cache of their dtype, bf16 queries. Run by
tests/kernels/test_paged_attention_fp8.py; prints one line per variant, "ok" or the error."""

from __future__ import annotations

import os
import sys
from typing import Any

assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the real Triton, not the interpreter"

from hopper_target import compile_for_hopper, report  # noqa: E402  (beside this script)
from triton.compiler import ASTSource  # noqa: E402

from asyncllm.kernels import paged_attention_cascade as pac  # noqa: E402
from asyncllm.kernels import paged_attention_kernels as pak  # noqa: E402
from asyncllm.kernels import qk_norm_rope_kv as qk  # noqa: E402

TYPES = {"bf16": ("*bf16", "tf32"), "fp16": ("*fp16", "tf32"), "fp32": ("*fp32", "ieee")}
FLOATS = ("qk_scale", "eps")


def _compile(
    fn: Any, pointers: dict[str, str], consts: dict[str, object], warps: int, stages: int = 3, pdl: bool = False
) -> None:
    """Every argument not named in `pointers` or `consts` is an int32 (a float32 for FLOATS); pointers and strides
    are specialized as a launch at these shapes specializes them: multiples of 16."""
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    divisible = [name for name in fn.arg_names if name in pointers or name.startswith("stride")]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    compile_for_hopper(source, num_warps=warps, num_stages=stages, launch_pdl=pdl)


def _cache(act: str, fp8: bool) -> tuple[str, dict[str, str]]:
    ptr = "*fp8e4nv" if fp8 else TYPES[act][0]
    scale = "*fp32" if fp8 else TYPES[act][0]  # the launchers pass q for unread scales
    return ptr, {"k_scale_ptr": scale, "v_scale_ptr": scale}


def decode(
    act: str, fp8: bool, sliding: bool, cascade: bool = False, fold: bool = False, group: int = 2, pdl: bool = False
) -> None:
    """FOLD: the split kernel's own merge (paged_attention_fold.py); group 7 pads the query heads (BLOCK_G 16);
    PDL: launched as a programmatic dependent (kernels/pdl.py)."""
    ptr, precision = TYPES[act]
    cache, scales = _cache(act, fp8)
    pointers = {"q_ptr": ptr, "k_ptr": cache, "v_ptr": cache, "out_ptr": ptr}
    pointers |= {name: "*fp32" for name in ("acc_ptr", "m_ptr", "l_ptr")}
    pointers |= {name: "*i32" for name in ("bt_ptr", "seq_lens_ptr", "qsl_ptr", "seqs_ptr", "skip_ptr", "counter_ptr")}
    consts = dict(GROUP=group, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64,
                  DOT_PRECISION=precision, SLIDING=sliding, KV_FP8=fp8, CASCADE=cascade, FOLD=fold,
                  BLOCK_S=32, PDL=pdl)  # fmt: skip
    _compile(pak._decode_split_kernel, pointers | scales, consts, warps=4, stages=2, pdl=pdl)


def reduce(cascade: bool = False) -> None:
    pointers = {"out_ptr": "*bf16", "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "qsl_ptr": "*i32",
                "seqs_ptr": "*i32", "skip_ptr": "*i32"}  # fmt: skip
    consts = dict(HEAD_DIM=128, BLOCK_S=32, BLOCK_D=128, CASCADE=cascade)
    _compile(pak._decode_reduce_kernel, pointers, consts, warps=4)


def cascade_prefix(act: str, fp8: bool, head_dim: int = 128) -> None:
    """At the launcher's choices for 16 query over 8 KV heads: 64 rows (32 members x 2 query heads), 4 warps,
    block_n 64 (32 when a K/V row of the queries' dtype passes 256 bytes: float32, head_dim 256)."""
    ptr, precision = TYPES[act]
    cache, scales = _cache(act, fp8)
    pointers = {"q_ptr": ptr, "k_ptr": cache, "v_ptr": cache}
    pointers |= {name: "*fp32" for name in ("acc_ptr", "m_ptr", "l_ptr")}
    pointers |= {name: "*i32" for name in ("bt_ptr", "qsl_ptr", "seqs_ptr", "units_ptr", "members_ptr")}
    block_n = 32 if (4 if act == "fp32" else 2) * head_dim > 256 else 64
    consts = dict(GROUP=2, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_D=head_dim, BLOCK_N=block_n,
                  DOT_PRECISION=precision, KV_FP8=fp8)  # fmt: skip
    _compile(pac._cascade_prefix_kernel, pointers | scales, consts, warps=4, stages=2)


def prefill(act: str, fp8: bool, sliding: bool) -> None:
    """At paged_prefill_attention's choices: block_m 128 (64 in float32), block_n 64 (32 when a K/V row of the
    queries' dtype passes 256 bytes), 8 warps at block_m 128."""
    ptr, precision = TYPES[act]
    cache, scales = _cache(act, fp8)
    big = act == "fp32"
    pointers = {"q_ptr": ptr, "k_ptr": cache, "v_ptr": cache, "out_ptr": ptr}
    pointers |= {name: "*i32" for name in ("bt_ptr", "seq_lens_ptr", "qsl_ptr", "tiles_ptr")}
    consts = dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=64 if big else 128, BLOCK_D=128,
                  BLOCK_N=32 if big else 64, DOT_PRECISION=precision, TILES_HEADER=4, SLIDING=sliding,
                  KV_FP8=fp8)  # fmt: skip
    _compile(pak._prefill_kernel, pointers | scales, consts, warps=4 if big else 8, stages=2 if big else 3)


def qk_norm_rope_kv(act: str, fp8: bool, norm: bool, unit_offset: bool = False) -> None:
    """16 query heads over 8 KV heads (block_r 4, block_half 64: 2 warps), as the launcher picks."""
    ptr = TYPES[act][0]
    cache, scales = _cache(act, fp8)
    pointers = {"qkv_ptr": ptr, "q_w_ptr": ptr, "k_w_ptr": ptr, "q_out_ptr": ptr, "k_cache_ptr": cache,
                "v_cache_ptr": cache, "pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32",
                "sin_ptr": "*fp32"}  # fmt: skip
    consts = dict(NUM_HEADS=16, NUM_KV_HEADS=8, GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_R=4, BLOCK_HALF=64,
                  HAS_NORM=norm, UNIT_OFFSET=unit_offset, KV_FP8=fp8, PDL=False)  # fmt: skip
    _compile(qk._qk_norm_rope_kv_kernel, pointers | scales, consts, warps=2)


VARIANTS = [
    ("decode bf16", lambda: decode("bf16", False, False)),
    ("decode bf16 over e4m3", lambda: decode("bf16", True, False)),
    ("decode bf16 over e4m3 sliding", lambda: decode("bf16", True, True)),
    ("decode fp32 over e4m3", lambda: decode("fp32", True, False)),
    ("decode reduce", reduce),
    ("decode bf16 fold", lambda: decode("bf16", False, False, fold=True)),
    ("decode fp16 fold group 7", lambda: decode("fp16", False, False, fold=True, group=7)),
    ("decode fp32 fold sliding", lambda: decode("fp32", False, True, fold=True)),
    ("decode bf16 over e4m3 fold", lambda: decode("bf16", True, False, fold=True)),
    ("decode bf16 fold pdl", lambda: decode("bf16", False, False, fold=True, pdl=True)),
    ("decode bf16 cascade", lambda: decode("bf16", False, False, cascade=True)),
    ("decode bf16 over e4m3 cascade", lambda: decode("bf16", True, False, cascade=True)),
    ("decode reduce cascade", lambda: reduce(cascade=True)),
    ("cascade prefix bf16", lambda: cascade_prefix("bf16", False)),
    ("cascade prefix bf16 over e4m3", lambda: cascade_prefix("bf16", True)),
    ("cascade prefix fp32", lambda: cascade_prefix("fp32", False)),
    ("cascade prefix bf16 head_dim 256", lambda: cascade_prefix("bf16", False, head_dim=256)),
    ("prefill bf16", lambda: prefill("bf16", False, False)),
    ("prefill bf16 over e4m3", lambda: prefill("bf16", True, False)),
    ("prefill bf16 over e4m3 sliding", lambda: prefill("bf16", True, True)),
    ("prefill fp32 over e4m3", lambda: prefill("fp32", True, False)),
    ("qk_norm_rope_kv bf16 qwen3", lambda: qk_norm_rope_kv("bf16", False, True)),
    ("qk_norm_rope_kv bf16 qwen3 into e4m3", lambda: qk_norm_rope_kv("bf16", True, True)),
    ("qk_norm_rope_kv bf16 llama into e4m3", lambda: qk_norm_rope_kv("bf16", True, False)),
    ("qk_norm_rope_kv fp16 gemma into e4m3", lambda: qk_norm_rope_kv("fp16", True, True, unit_offset=True)),
    ("qk_norm_rope_kv fp32 qwen3 into e4m3", lambda: qk_norm_rope_kv("fp32", True, True)),
]

if __name__ == "__main__":
    sys.exit(report(VARIANTS))
