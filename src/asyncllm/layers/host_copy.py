"""Host-to-device copies that never make the host wait: the one way per-step index and parameter tensors
reach the GPU (attention plans, sampler parameters, penalty tables).

A plain pageable copy to CUDA blocks the host until the stream drains; staging through pinned memory lets
the copy queue behind the work already launched. torch's caching host allocator keeps the pinned staging
buffer alive until its copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[Sequence[float]] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Host values (a sequence, rows of them, or a CPU tensor) as `dtype` on `device`, without a host sync."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, values: Sequence[int] | Sequence[float]) -> None:
    """Host values into the first len(values) elements of the 1-D tensor `dst` (kept at its address: a CUDA
    graph reads it), without a host sync."""
    host = torch.tensor(values, dtype=dst.dtype, pin_memory=dst.device.type == "cuda")
    dst[: host.shape[0]].copy_(host, non_blocking=True)
