"""Choosing how each linear layer's weight is laid out in memory, by timing cuBLAS on this GPU.

The GEMMs stay cuBLAS, but cuBLAS picks its kernel from the operands' layout, and at decode batch sizes
the choice matters: some shapes run much faster from a weight stored [in, out] than from the usual
[out, in] (bench/kernels/bench_gemm.py measures it; bench/RESULTS.md has the figures). A weight
stored [in, out] is still seen by the model as an [out, in] view, so the maths and the model code do not
change. Only 16-bit weights are tuned: float32 keeps one layout, and so its bit-exact parity tests.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.linear import Linear

_ROWS = (1, 8, 64, 256, 2048)  # decode batch sizes, and a prefill chunk


def tune_weight_layouts(model: nn.Module, device: torch.device) -> dict[tuple[int, int], bool]:
    """Store each linear weight in the layout cuBLAS runs fastest here; returns {(in, out): transposed}."""
    layers: dict[tuple[int, int], list[Linear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype in (torch.bfloat16, torch.float16):
            out_features, in_features = module.weight.shape
            layers[(in_features, out_features)].append(module)
    choices: dict[tuple[int, int], bool] = {}
    for shape, modules in layers.items():
        choices[shape] = _transposed_is_faster(modules[0].weight.detach(), device)
        if choices[shape]:
            for module in modules:
                module.store_weight_transposed()
    return choices


@torch.inference_mode()
def _transposed_is_faster(weight: torch.Tensor, device: torch.device) -> bool:
    """Time F.linear from both layouts at every row count; each row count weighs the same (time relative to
    the faster layout), so a prefill-sized GEMM does not drown the decode ones."""
    plain = weight
    transposed = weight.t().contiguous().t()  # [out, in] view of an [in, out] tensor
    score = {False: 0.0, True: 0.0}
    for rows in _ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=device)
        times = {
            False: graph_time_us(partial(F.linear, x, plain)),
            True: graph_time_us(partial(F.linear, x, transposed)),
        }
        best = min(times.values())
        for layout, t in times.items():
            score[layout] += t / best
    return score[True] < score[False] * 0.98  # a clear win only: otherwise keep the checkpoint's layout


def graph_time_us(
    fns: Callable[[], object] | Sequence[Callable[[], object]], calls: int = 10, repeats: int = 5
) -> float:
    """GPU microseconds per call, from replays of a CUDA graph of `calls` calls cycling through `fns` (eager
    launches of a few-microsecond GEMM would time the host, not the GPU)."""
    fns = [fns] if callable(fns) else list(fns)
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # see CudaGraphRunner.capture
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    times: list[float] = []
    for _ in range(repeats):
        # torch's stubs leave Event's constructor unannotated
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
