"""Resolving the user's device and dtype choices into torch objects."""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.config import Device, DType
from asyncllm.errors import DeviceError

_DTYPES = {DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16, DType.FLOAT32: torch.float32}


def resolve_device(choice: Device) -> torch.device:
    if choice is Device.CPU:
        return torch.device("cpu")
    if choice is Device.CUDA and not torch.cuda.is_available():
        raise DeviceError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    if choice is Device.CUDA or torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_dtype(choice: DType, device: torch.device, hf_config: Any) -> torch.dtype:
    """ "auto": float32 on CPU (exact and fast there); on CUDA the checkpoint's 16-bit dtype, else bfloat16."""
    if choice is not DType.AUTO:
        return _DTYPES[choice]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16
