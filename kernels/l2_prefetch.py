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
