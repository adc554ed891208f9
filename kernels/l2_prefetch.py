"""Asking L2 for memory a kernel reads later without waiting for it (`prefetch.global.L2`, CUDA only): weights
do not depend on the activations, so a kernel may ask for its share while it still waits on the kernels before
(a PDL `gdc_wait`, a grid barrier). A hint: no result depends on it; every address stays inside the tensor.
Triton's interpreter has no PTX: callers take it behind a constexpr the CPU never sets.
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = tl.constexpr(128)  # an L2 request's granularity on NVIDIA GPUs


@triton.jit
def prefetch_l2(ptrs):
    """One `prefetch.global.L2` for each address in `ptrs` (a pointer tensor of any shape)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch_rows_l2(row_ptrs, first, count, LINES: tl.constexpr, ITEM: tl.constexpr):
    """Asks L2 for elements [first, first + count) of each row in `row_ptrs` ([R, 1] pointers to the rows'
    element 0; ITEM bytes an element), one request a 128-byte line, LINES lines of every row at a time."""
    per_line: tl.constexpr = LINE_BYTES // ITEM
    # Lines counted from the first one's start: a range that does not start on a line spills into one more.
    lines = tl.cdiv(first % per_line + count, per_line)
    last = first + count - 1
    for start in range(0, lines, LINES):
        at = tl.minimum(first + (start + tl.arange(0, LINES)) * per_line, last)  # [LINES], inside the range
        prefetch_l2(row_ptrs + at[None, :])


@triton.jit
def prefetch_bulk_l2(byte_ptrs, nbytes):
    """One `cp.async.bulk.prefetch.L2` (sm_90+) for each address in `byte_ptrs` with its size in `nbytes`
    (int32, a multiple of 16 from a 16-byte-aligned address; 0: none): the SM's copy engine streams the range
    into L2 while the threads go on, one instruction a range however long, so asking costs nothing."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [byte_ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch_span_l2(ptr, first, count, THREADS: tl.constexpr, PIECES: tl.constexpr):
    """Asks L2 for elements [first, first + count) of the tensor at `ptr` in PIECES bulk requests, one a thread
    (THREADS: the program's threads, so the [THREADS] request tensor has one element a thread and none is
    issued twice; PIECES <= THREADS); the range's start and length in bytes multiples of 16."""
    item: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    total = count * item
    piece = tl.cdiv(tl.cdiv(total, PIECES), 16) * 16
    offs = tl.arange(0, THREADS) * piece
    size = tl.minimum(tl.maximum(total - offs, 0), piece).to(tl.int32)
    base = (ptr + first.to(tl.int64)).to(tl.pointer_type(tl.int8))
    prefetch_bulk_l2(base + offs, size)
