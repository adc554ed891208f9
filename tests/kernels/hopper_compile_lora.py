"""Compiles the batched LoRA kernels (kernels/lora.py: fused, split-K shrink, expand) for Hopper (sm_90) without
a GPU: Triton's compiler up to PTX (tests/kernels/hopper_target.py), in a process without TRITON_INTERPRET, at
the launch shapes `plan_lora_launch` picks for Qwen3-0.6B's qkv and down layers at a decode step's 64 rows and
a prompt step's 8,192 (each distinct kernel once), at ranks 16, 64 and 512 in bf16, rank 16 in fp16 and fp32.
Also checks each variant's shared memory against the H100/H200's 227 KiB a program may take (a launch past it
fails on the device only). Run by tests/kernels/test_lora.py; prints one line per variant, "ok" or the error."""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any

assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the real Triton, not the interpreter"

from hopper_target import compile_for_hopper, report  # noqa: E402  (beside this script)
from triton.compiler import ASTSource  # noqa: E402

from asyncllm.kernels import lora  # noqa: E402
from asyncllm.kernels.lora_plan import (  # noqa: E402
    FUSED_WARPS,
    LORA_BLOCK_M,
    MAX_SPLITS,
    SPLIT_WARPS,
    LoRALaunch,
    plan_lora_launch,
)

SHARED_LIMIT = 232_448  # bytes of shared memory one program may take on sm_90
TYPES = {"bf16": ("*bf16", "tf32"), "fp16": ("*fp16", "tf32"), "fp32": ("*fp32", "ieee")}
SHAPES = {"qkv": (1024, (2048, 1024, 1024)), "down": (3072, (1024,))}  # at 64 rows: fused, then split
ROWS = (64, 2048, 8192)  # a decode step, a prompt chunk (qkv fused over several tiles), a long prompt step (split)


def _compile(fn: Any, pointers: dict[str, str], ints: list[str], consts: dict[str, object], warps: int) -> None:
    signature = pointers | {name: "i32" for name in ints} | {name: "constexpr" for name in consts}
    # As a launch at these shapes specializes: pointers, strides, K and shard widths are multiples of 16
    wide = ("K", "k_chunk", "N0", "N1", "N2")
    divisible = [*pointers, *(name for name in ints if name.startswith("stride") or name in wide)]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    compiled = compile_for_hopper(source, num_warps=warps, num_stages=3)
    shared = compiled.metadata.shared
    assert shared <= SHARED_LIMIT, f"takes {shared} bytes of shared memory, more than sm_90's {SHARED_LIMIT}"


def variant(dtype: str, rank: int, launch: LoRALaunch, shards: int) -> None:
    ptr, precision = TYPES[dtype]
    columns = ["N0", "N1", "N2", "NB0", "NB1"]
    common = dict(R=rank, BLOCK_M=LORA_BLOCK_M, DOT_PRECISION=precision)
    rows = {"tokens_ptr": "*i32", "slots_ptr": "*i32"}
    if launch.path == "fused":
        pointers = {"x_ptr": ptr, "a_ptr": ptr, "b_ptr": ptr, "y_ptr": ptr} | rows
        ints = ["K", "tiles", "stride_x", "stride_as", "stride_ar", "stride_bs", "stride_bn", "stride_y", *columns]
        consts = common | dict(BLOCK_N=launch.block_n, BLOCK_K=launch.block_k)
        _compile(lora._lora_fused_kernel, pointers, ints, consts, FUSED_WARPS)
        return
    pointers = {"x_ptr": ptr, "a_ptr": ptr, "h_ptr": "*fp32"} | rows
    ints = ["K", "k_chunk", "stride_x", "stride_as", "stride_ar", "stride_hs", "stride_h"]
    consts = dict(NUM_SHARDS=shards) | common | dict(BLOCK_K=launch.block_k)
    _compile(lora._lora_shrink_kernel, pointers, ints, consts, SPLIT_WARPS)
    pointers = {"h_ptr": "*fp32", "b_ptr": ptr, "y_ptr": ptr} | rows
    ints = ["splits", "stride_hs", "stride_h", "stride_bs", "stride_bn", "stride_y", *columns]
    unroll = MAX_SPLITS if rank * MAX_SPLITS <= lora.UNROLLED_SPLIT_COLUMNS else 1
    consts = common | dict(BLOCK_N=launch.block_n, UNROLL_SPLITS=unroll)
    _compile(lora._lora_expand_kernel, pointers, ints, consts, SPLIT_WARPS)


def variants() -> list[tuple[str, str, int, LoRALaunch, int]]:
    """Each distinct compiled kernel once: a launch's tiles and splits are run-time arguments."""
    out, seen = [], set()
    for dtype, itemsize in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
        for rank in (16, 64, 512) if dtype == "bf16" else (16,):
            for layer, (k, sizes) in SHAPES.items():
                for rows in ROWS:
                    launch = plan_lora_launch(rows, 8, k, sizes, rank, itemsize)
                    key = (dtype, rank, len(sizes), launch.path, launch.block_n, launch.block_k)
                    if key not in seen:
                        seen.add(key)
                        name = f"{dtype} rank {rank} {layer} {rows} rows {launch}"
                        out.append((name, dtype, rank, launch, len(sizes)))
    return out


if __name__ == "__main__":
    sys.exit(report([(name, partial(variant, *args)) for name, *args in variants()]))
