"""Programmatic dependent launch (PDL; CUDA on Hopper or newer): a kernel launched with `launch_pdl` may be
scheduled while the kernel before it in the stream is still running, so back-to-back small launches (the
batch-1 decode graph's) overlap one's launch with the other's tail. The contract every kernel taking a `PDL`
constexpr keeps: with PDL on it calls `tl.extra.cuda.gdc_wait()` before its first load or store (the previous
kernel has then finished and its writes are visible), then `gdc_launch_dependents()` to let the next launch
early. Before the wait a kernel may only touch what no kernel writes: asking L2 for its weights
(kernels/l2_prefetch.py) is the one use. CUDA graphs captured from a stream keep the programmatic edges. Knows
nothing of which kernels use it.
"""

from __future__ import annotations


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """The launch keyword a Triton kernel takes for PDL: none when off (Triton's interpreter knows no such
    option, so a CPU launch never carries it)."""
    return {"launch_pdl": True} if pdl else {}
