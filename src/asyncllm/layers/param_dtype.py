"""The dtype a model's parameters are allocated in while it is being built.

The loader builds a model directly in its serving dtype, so a bfloat16 model never exists first in float32 (a
30B model would need 122 GB on the device for a moment, not 61). A context variable rather than torch's
process-wide default dtype: tensors another thread creates meanwhile keep their own dtype, and buffers a layer
computes at construction (rotary tables, scales) are still computed in float32 and cast once by the loader.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

_PARAM_DTYPE: ContextVar[torch.dtype | None] = ContextVar("asyncllm_param_dtype", default=None)


@contextmanager
def parameters_in(dtype: torch.dtype) -> Iterator[None]:
    """Layers built inside allocate their (uninitialised) parameters in `dtype`."""
    token = _PARAM_DTYPE.set(dtype)
    try:
        yield
    finally:
        _PARAM_DTYPE.reset(token)


def empty_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised parameter of `shape`, in the dtype `parameters_in` set (torch's default outside it)."""
    dtype = _PARAM_DTYPE.get()
    return nn.Parameter(torch.empty(*shape, dtype=dtype if dtype is not None else torch.get_default_dtype()))
