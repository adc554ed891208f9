"""Compiles the persistent decode layer (kernels/decode_layer_kernels.py) for Hopper (sm_90) without a GPU:
Triton's compiler up to PTX (tests/kernels/hopper_target.py), in a process without TRITON_INTERPRET, at the
constants its launcher picks for Qwen3-0.6B and -8B (one row: CUDA-core products; 4 rows: the 16-row dot) in
bf16 and at a float32 case. Run by tests/kernels/test_decode_layer.py; prints one line per variant."""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any

assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the real Triton, not the interpreter"

import torch  # noqa: E402
from hopper_target import compile_for_hopper, report  # noqa: E402  (beside this script)
from triton.compiler import ASTSource  # noqa: E402

from asyncllm.kernels import decode_layer as dl  # noqa: E402
from asyncllm.kernels import decode_layer_kernels as dlk  # noqa: E402

SHAPES = {  # hidden, heads, kv heads, head_dim, intermediate
    "Qwen3-0.6B": (1024, 16, 8, 128, 3072),
    "Qwen3-8B": (4096, 32, 8, 128, 12288),
}
POINTERS = ("x_ptr", "res_ptr", "in_norm_ptr", "qkv_w_ptr", "q_norm_ptr", "k_norm_ptr", "o_w_ptr", "post_norm_ptr",
            "gate_up_w_ptr", "down_w_ptr", "k_cache_ptr", "v_cache_ptr", "qkv_ptr", "attn_ptr", "act_ptr",
            "out_ptr", "h1_ptr", "next_qkv_w_ptr")  # fmt: skip
# What a launch on the GPU gets told: its tensors start on 16 bytes and these strides are multiples of 16 (Triton
# specialises on both), so its loads are vectorised; without it this would compile another kernel (scalar loads,
# other registers).
ALIGNED_INTS = ("stride_cos", "stride_sin", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
                "stride_vh")  # fmt: skip
INTS = ("rows", "num_splits", "stride_cos", "stride_sin", "stride_bt", "stride_kb", "stride_kt", "stride_kh",
        "stride_vb", "stride_vt", "stride_vh")  # fmt: skip


def variant(shape: str, rows: int, dtype: str, stages: int = 1, prefetch: str = "off", preload: bool = False) -> Any:
    hidden, heads, kv_heads, dim, inter = SHAPES[shape]
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    meta = torch.empty(0, dtype=torch_dtype, device="meta")
    w = dl.DecodeLayerWeights(
        meta.new_empty(hidden), meta.new_empty((heads + 2 * kv_heads) * dim, hidden), meta.new_empty(dim),
        meta.new_empty(dim), meta.new_empty(hidden, heads * dim), meta.new_empty(hidden),
        meta.new_empty(2 * inter, hidden), meta.new_empty(hidden, inter), heads, kv_heads, dim, 1e-6,
    )  # fmt: skip
    config = dl.plan_config(w, rows, 132, stages=stages, prefetch=prefetch, preload=preload)
    signature = {name: f"*{dtype}" for name in POINTERS}
    signature |= {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "bt_ptr": "*i32",
                  "seq_lens_ptr": "*i32", "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                  "tickets_ptr": "*i32", "bar_ptr": "*i32", "clock_ptr": "*i64", "eps": "fp32",
                  "qk_scale": "fp32"}  # fmt: skip
    signature |= {name: "i32" for name in INTS}
    consts = dl.launch_constants(w, hidden, rows, config, torch_dtype, block_size=16, residual=True)
    consts["PHASE"] = 0
    consts["PTX"] = True  # the meta tensors' device is not CUDA; the kernel compiled here is the GPU's
    consts["NEXT"] = prefetch == "ahead"
    consts["TIMING"] = stages > 1  # the clock's stamps compiled in one variant
    warps = consts.pop("num_warps")
    signature |= {name: "constexpr" for name in consts}
    names = dlk._decode_layer_kernel.arg_names
    ordered = {name: signature[name] for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if ordered[name].startswith("*") or name in ALIGNED_INTS}  # fmt: skip
    source = ASTSource(fn=dlk._decode_layer_kernel, signature=ordered, constexprs=consts, attrs=attrs)
    return compile_for_hopper(source, num_warps=warps)


if __name__ == "__main__":
    cases = (("Qwen3-0.6B", 1, "bf16", 1, "ahead", False), ("Qwen3-0.6B", 4, "bf16", 1, "off", False),
             ("Qwen3-8B", 1, "bf16", 3, "lines", False), ("Qwen3-8B", 8, "bf16", 3, "bulk", False),
             ("Qwen3-0.6B", 2, "fp32", 1, "off", False), ("Qwen3-0.6B", 1, "bf16", 1, "ahead", True),
             ("Qwen3-8B", 4, "bf16", 1, "off", True), ("Qwen3-0.6B", 1, "bf16", 1, "off", True))  # fmt: skip
    names = [f"decode layer {shape} {rows} rows {dtype} {stages} stages prefetch {prefetch}"
             f"{' preload' if preload else ''}" for shape, rows, dtype, stages, prefetch, preload in cases]  # fmt: skip
    sys.exit(report([(name, partial(variant, *case)) for name, case in zip(names, cases)]))
