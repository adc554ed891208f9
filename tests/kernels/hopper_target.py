"""Hopper (sm_90) as a compile target for the kernel scripts that run without a GPU (hopper_compile*.py).

`compile_for_hopper` runs Triton's real compiler through the PTX it emits: the front end, the GPU dialect
(layouts, shared memory: `metadata.shared`), LLVM IR and LLVM's PTX. These refuse what the interpreter
accepts (a plain module global read in a kernel, a shape that is not a power of two, an unsupported
conversion). ptxas, the last stage, is skipped: it assembles the PTX Triton has already lowered for this
target, took a quarter of the scripts' CPU time, and the GPU suite (bench/gpu_check.sh) assembles and runs
every kernel on each device call. Where this Triton has no stage hook, the whole pipeline runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)


def _without_ptxas(*args: Any) -> Any:
    """Triton's stage hook: with no arguments, the key this changes the compile cache by; else it edits the
    backend's stages in place, the cubin stage becoming an empty binary (never launched: no GPU here)."""
    if not args:
        return "no-ptxas", "1"
    stages = args[1]
    if "cubin" in stages:
        stages["cubin"] = lambda src, metadata: b""
    return None


def compile_for_hopper(source: Any, **options: Any) -> Any:
    """`triton.compile(source)` for sm_90 with `options`, up to and including PTX."""
    if hasattr(knobs, "runtime") and hasattr(knobs.runtime, "add_stages_inspection_hook"):
        knobs.runtime.add_stages_inspection_hook = _without_ptxas
    return triton.compile(source, target=TARGET, options=options)


def report(variants: list[tuple[str, Callable[[], object]]]) -> int:
    """Compiles each (name, compile) variant, printing "ok NAME" or "FAILED NAME: error" for every one; returns
    the exit status (1 when any failed)."""
    failed = 0
    for name, compile_variant in variants:
        try:
            compile_variant()
            print(f"ok {name}", flush=True)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0
