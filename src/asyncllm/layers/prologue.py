"""The op before a linear layer folded into that layer's GEMV at one token row (batch-1 decode): RMSNorm (with
the residual add before it) -> a projection, and SiLU-and-mul -> down_proj, each pair one launch
(kernels/gemv_prologue.py) instead of two. A model calls `norm_linear` / `act_linear` where such a pair
sits, and lists its pairs (`ProloguePairs`); the worker turns a pair on (`Linear.use_prologue_gemv`) only
where `fusable` holds and, under "auto", where it timed faster. Otherwise both run as they always did, so
the torch forms stay the reference. Knows nothing of which model or worker uses it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from asyncllm.layers.activation import SiluAndMul
from asyncllm.layers.linear import Linear, PackedLinear
from asyncllm.layers.norm import RMSNorm

_GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PrologueKind(enum.Enum):
    RMS_NORM = "rms_norm"  # transformers' RMSNorm, with or without the residual add before it
    SILU_MUL = "silu_mul"  # silu(gate) * up over a packed [gate | up] row


@dataclass(frozen=True)
class ProloguePair:
    """An op and the linear layer that alone consumes its output."""

    kind: PrologueKind
    op: nn.Module
    linear: nn.Module


@runtime_checkable
class ProloguePairs(Protocol):
    def prologue_pairs(self) -> list[ProloguePair]:
        """The (op -> linear) pairs of this module that it calls through `norm_linear` / `act_linear`."""
        ...


def model_pairs(model: nn.Module) -> list[ProloguePair]:
    """Every pair the model's modules list."""
    return [pair for m in model.modules() if isinstance(m, ProloguePairs) for pair in m.prologue_pairs()]


def fusable(pair: ProloguePair) -> bool:
    """Whether the pair's one-row call can be one launch: a plain dense layer (not LoRA-wrapped, quantized or
    row-parallel) of a float weight in the [out, in] layout, after transformers' RMSNorm (not Gemma's form)
    or SiLU-and-mul, each with its fused kernel on (the Triton backend)."""
    linear, op = pair.linear, pair.op
    if type(linear) not in (Linear, PackedLinear):
        return False
    assert isinstance(linear, Linear)
    weight = linear.weight
    if weight.dtype not in _GEMV_DTYPES or weight.stride(1) != 1:
        return False
    if pair.kind is PrologueKind.RMS_NORM:
        return type(op) is RMSNorm and op.fused and op.weight.dtype == weight.dtype
    return type(op) is SiluAndMul and op.fused


def norm_linear(
    norm: nn.Module,
    linear: nn.Module,
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden]; None: x is the residual stream itself (the first layer)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(h)), h) with h = x + residual (x when residual is None): the norm's output feeds only
    `linear`. One launch at one token row where the pair is on."""
    if isinstance(linear, Linear) and linear.prologue_gemv and x.dim() == 2 and x.shape[0] == 1:
        assert isinstance(norm, RMSNorm)
        y, h = linear.project_normed(x, norm.weight, norm.eps, residual)
        return y, x if h is None else h
    if residual is None:
        return linear(norm(x)), x
    x, residual = norm(x, residual)
    return linear(x), residual


def act_linear(act: nn.Module, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(act(x)) for x = [gate | up]: one launch at one token row where the pair is on."""
    if isinstance(linear, Linear) and linear.prologue_gemv and x.dim() == 2 and x.shape[0] == 1:
        return linear.project_silu_mul(x)
    return linear(act(x))  # type: ignore[no-any-return]
