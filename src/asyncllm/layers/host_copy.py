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
    values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host values (a sequence or a CPU tensor) as `dtype` on `device`, without a host sync."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
