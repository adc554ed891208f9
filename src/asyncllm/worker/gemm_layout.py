"""Choosing each linear layer's GEMMs by timing them on this GPU: the layout cuBLAS reads the weight in, and at
one token row (batch-1 decode) cuBLAS or the one-launch GEMV (kernels/quant_matmul_gemv.py, `Linear.use_gemv`).

cuBLAS picks its kernel from the operands' layout, and at decode batch sizes the choice matters: some shapes
run much faster from a weight stored [in, out] than from the usual [out, in] (bench/kernels/bench_gemm.py
measures it; bench/RESULTS.md has the figures). A weight stored [in, out] is still seen by the model as an
[out, in] view, so the maths and the model code do not change. At one token row cuBLAS reads small weights at
a fraction of the bandwidth where the GEMV (split K, reduced in the same launch) streams them; the GEMV reads
the [out, in] layout, so a shape taking it keeps that layout unless [in, out] wins the other row counts by
more. Each shape is timed once, over several of its layers in turn (weights read from memory, not from L2), and
its choice kept on disk for the next start on the same card and software (tuning_cache.py).
Only 16-bit weights are timed: float32 keeps one layout and cuBLAS, and so its bit-exact parity tests. A layer
after a norm or SiLU-and-mul it can fold into its GEMV (layers/prologue.py) is timed as that pair too, the
op's own launch counted as saved.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.envs import DecodeGemv
from asyncllm.layers.linear import Linear
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.prologue import PrologueKind, fusable, model_pairs
from asyncllm.quantization.linear import QuantLinear
from asyncllm.worker.tuning_cache import ChoiceCache

_ROWS = (1, 8, 64, 256, 2048)  # decode batch sizes, and a prefill chunk
# A shape takes the GEMV only where it is clearly faster at one row; below this many weights both are
# launch-bound ties (and the tiny test models keep cuBLAS, so their graphed and eager runs match bit for bit).
GEMV_MARGIN = 0.95
GEMV_MIN_WEIGHTS = 1 << 18
_TUNED_DTYPES = (torch.bfloat16, torch.float16)
_GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_TIMED_LAYERS = 24  # Qwen3-0.6B's 4 MB o_proj: 24 layers, twice the H200's 50 MB L2

Shape = tuple[int, int, torch.dtype]  # (out, in, dtype)


@dataclass(frozen=True)
class GemmChoice:
    """What the timings chose for one weight shape."""

    transposed: bool  # the weight stored [in, out] for cuBLAS
    gemv: bool  # one token row through the GEMV
    prologue: bool = False  # one token row through the GEMV with the op before it folded in (layers/prologue.py)


def set_decode_gemv(model: nn.Module, mode: DecodeGemv) -> None:
    """ASYNCLLM_DECODE_GEMV's fixed settings, before any timing: "on" turns the GEMV on in every dense layer that can
    take it, "off" turns it off everywhere (the quantized layers' too); "auto" leaves it to
    `tune_linear_layers`. Call it only where the Triton kernels run."""
    for module in model.modules():
        if isinstance(module, (Linear, QuantLinear)) and mode == DecodeGemv.OFF:
            module.use_gemv(False)
            if isinstance(module, Linear):
                module.use_prologue_gemv(False)
        elif isinstance(module, Linear) and mode == DecodeGemv.ON and module.weight.dtype in _GEMV_DTYPES:
            module.use_gemv(True)
    if mode == DecodeGemv.ON:
        for pair in model_pairs(model):
            if fusable(pair):
                assert isinstance(pair.linear, Linear)
                pair.linear.use_prologue_gemv(True)


def gemv_layers(model: nn.Module) -> int:
    """How many linear layers take the GEMV at one token row (a prologue's pairs included)."""
    return sum(
        isinstance(m, (Linear, QuantLinear)) and (m.gemv or (isinstance(m, Linear) and m.prologue_gemv))
        for m in model.modules()
    )


def prologue_layers(model: nn.Module) -> int:
    """How many linear layers fold the op before them into their GEMV at one token row."""
    return sum(isinstance(m, Linear) and m.prologue_gemv for m in model.modules())


def tune_linear_layers(model: nn.Module, device: torch.device, *, gemv: bool) -> dict[Shape, GemmChoice]:
    """Lay out each 16-bit linear weight as cuBLAS runs it fastest here and, with `gemv`, turn the GEMV on for
    the shapes it runs clearly faster at one row; returns the choice per shape. Layers already taking the GEMV
    (turned on before: ASYNCLLM_DECODE_GEMV=on) keep their layout."""
    # With `gemv`, the layers after an op they can fold in (layers/prologue.py) are timed as pairs too: a
    # shape's layers with and without such an op are separate groups.
    pairs = {id(p.linear): p for p in model_pairs(model) if fusable(p)} if gemv else {}
    groups: dict[tuple[Shape, PrologueKind | None], list[Linear]] = defaultdict(list)
    ops: dict[tuple[Shape, PrologueKind | None], nn.Module] = {}
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype in _TUNED_DTYPES and not module.gemv:
            if module.prologue_gemv:
                continue  # turned on before (ASYNCLLM_DECODE_GEMV=on)
            n, k = module.weight.shape
            pair = pairs.get(id(module))
            key = ((n, k, module.weight.dtype), None if pair is None else pair.kind)
            groups[key].append(module)
            if pair is not None:
                ops.setdefault(key, pair.op)
    choices: dict[Shape, GemmChoice] = {}
    kept = ChoiceCache.for_device(device)  # an earlier start's choices on this card (tuning_cache.py)
    for key, modules in groups.items():
        shape, kind = key
        n, k, dtype = shape
        timed = gemv and n * k >= GEMV_MIN_WEIGHTS
        weights = _weights_beyond_l2(modules, device)
        # The layers timed in turn are part of the key: a shallow model's fit in L2, and time faster than they run
        # in a deep model of the same shapes.
        mode = "gemv" if timed else "cublas"
        entry = f"{n}x{k}:{dtype}:{kind.value if kind is not None else '-'}:{mode}:{len(weights)}"
        found = kept.get(entry)
        if found is not None and _could_be_timed(found, timed, kind is not None):
            choice = GemmChoice(**found)
        else:
            prologue = (kind, ops[key]) if timed and kind is not None else None
            choice = _choose(weights, device, gemv=timed, prologue=prologue)
            kept.put(entry, dataclasses.asdict(choice))
        if kind is None or shape not in choices:
            choices[shape] = choice
        for module in modules:
            if choice.transposed:
                module.store_weight_transposed()
            elif choice.prologue:
                module.use_prologue_gemv(True)
            elif choice.gemv:
                module.use_gemv(True)
    kept.save()
    return choices


def _could_be_timed(found: dict[str, bool], gemv: bool, prologue: bool) -> bool:
    """Whether a kept choice is one the timing could have made for its entry (a hand-edited file could name a
    path the entry never timed: the GEMV for a shape timed against cuBLAS alone)."""
    return (gemv or not (found["gemv"] or found["prologue"])) and (prologue or not found["prologue"])


def _weights_beyond_l2(modules: list[Linear], device: torch.device) -> list[torch.Tensor]:
    """Enough of the layers' weights that reading them in turn overflows L2 (all of them when they don't)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    weight = modules[0].weight
    need = -(-2 * l2 // (weight.numel() * weight.element_size()))
    return [m.weight.detach() for m in modules[: max(1, min(need, _MAX_TIMED_LAYERS))]]


@torch.inference_mode()
def _choose(
    weights: list[torch.Tensor],
    device: torch.device,
    *,
    gemv: bool,
    prologue: tuple[PrologueKind, nn.Module] | None = None,
) -> GemmChoice:
    """Time F.linear from both layouts at every row count, with `gemv` the GEMV at one row (from the plain
    layout), and with `prologue` the GEMV folding that op in, less the op's own launch; `choose_gemm` decides."""
    layouts = {"plain": weights, "transposed": [w.t().contiguous().t() for w in weights]}  # [out, in] views
    times: dict[str, dict[int, float]] = {name: {} for name in layouts}
    for m in _ROWS:
        x = torch.randn(m, weights[0].shape[1], dtype=weights[0].dtype, device=device)
        for name, ws in layouts.items():
            times[name][m] = graph_time_us([partial(F.linear, x, w) for w in ws], calls=max(10, len(ws)))
    prologue_us = None if prologue is None else prologue_saving_us(weights, device, *prologue)
    # Start-up stays cheap: where the folded GEMV already beats cuBLAS, the plain one is not timed (nor compiled):
    # it is the same launch without the fold (a few reads from L2 a program), and would still pay the op's launch.
    cublas_one_row = min(t[1] for t in times.values())
    folded_wins = prologue_us is not None and prologue_us < GEMV_MARGIN * cublas_one_row
    gemv_us = _gemv_time_us(weights, device) if gemv and not folded_wins else None
    return choose_gemm(times, gemv_us, prologue_us)


def choose_gemm(
    cublas_us: dict[str, dict[int, float]], gemv_us: float | None, prologue_us: float | None = None
) -> GemmChoice:
    """The choice for one shape from cuBLAS's microseconds per call ({"plain" | "transposed": {rows: us}}), the
    GEMV's at one row (None: not timed) and the GEMV's with the op before it folded in, less that op's own
    time (None: not timed, or no such op). A GEMV counts only where it beats every other one-row path by
    GEMV_MARGIN; it then stands for the plain layout at one row. Each row count weighs the same in a layout's
    score (time relative to the fastest at that count), so a prefill-sized GEMM does not drown the decode
    ones; [in, out] is taken only for a clear win (2 %)."""
    times = {name: dict(t) for name, t in cublas_us.items()}
    cublas_one_row = min(t[1] for t in times.values())
    takes_gemv = gemv_us is not None and gemv_us < GEMV_MARGIN * cublas_one_row
    others = min(cublas_one_row, gemv_us if gemv_us is not None else cublas_one_row)
    takes_prologue = prologue_us is not None and prologue_us < GEMV_MARGIN * others
    if takes_prologue:
        assert prologue_us is not None
        # The saving can exceed a launch of the GEMM itself: bounded at half cuBLAS's time, so one row counts
        # at most twice in the layout's score and prefill-sized rows keep their say.
        times["plain"][1] = max(prologue_us, 0.5 * cublas_one_row)
    elif takes_gemv:
        assert gemv_us is not None
        times["plain"][1] = gemv_us
    rows = times["plain"].keys()
    best = {m: min(t[m] for t in times.values()) for m in rows}
    score = {name: sum(t[m] / best[m] for m in rows) for name, t in times.items()}
    transposed = score["transposed"] < score["plain"] * 0.98
    return GemmChoice(
        transposed=transposed,
        gemv=takes_gemv and not takes_prologue and not transposed,
        prologue=takes_prologue and not transposed,
    )


def _gemv_time_us(weights: list[torch.Tensor], device: torch.device) -> float:
    from asyncllm.kernels.quant_matmul_gemv import gemv_locks, linear_gemv

    n, k = weights[0].shape
    x = torch.randn(1, k, dtype=weights[0].dtype, device=device)
    locks = gemv_locks(n, 1, device)
    return graph_time_us([partial(linear_gemv, x, w, locks=locks) for w in weights], calls=max(10, len(weights)))


def prologue_saving_us(weights: list[torch.Tensor], device: torch.device, kind: PrologueKind, op: nn.Module) -> float:
    """GPU microseconds per one-row call of the GEMV folding `op` in, less `op`'s own launch (its fused
    kernel, as the unfused pair runs it): what the linear layer costs at one row through the pair. Norms are
    timed with the residual add (every layer's but the first)."""
    from asyncllm.kernels import quant_matmul_gemv as kernels

    n, k = weights[0].shape
    dtype = weights[0].dtype
    locks = kernels.gemv_locks(n, 1, device)
    calls = max(10, len(weights))
    fused: list[Callable[[], object]]
    if kind is PrologueKind.RMS_NORM:
        assert isinstance(op, RMSNorm)
        x, residual = (torch.randn(1, k, dtype=dtype, device=device) for _ in range(2))
        norm_weight = op.weight.detach()
        fused = [
            partial(kernels.rms_norm_gemv, x, norm_weight, op.eps, w, residual=residual, locks=locks) for w in weights
        ]
        alone = partial(op, x, residual.clone())  # its residual grows by x each call: harmless for a timing
    else:
        gate_up = torch.randn(1, 2 * k, dtype=dtype, device=device)
        fused = [partial(kernels.silu_mul_gemv, gate_up, w, locks=locks) for w in weights]
        alone = partial(op, gate_up)
    return graph_time_us(fused, calls=calls) - graph_time_us(alone, calls=calls)


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
