"""Building a model on its device and filling its weights, from a checkpoint or at random.

Knows which model class serves a checkpoint (through the registry) and how weights reach it; knows
nothing of KV caches, batching or the engine.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import LoadFormat
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.dummy import fill_dummy_weights
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class


def load_model(
    checkpoint: Checkpoint,
    arch: ModelArchConfig,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    load_format: LoadFormat,
    seed: int,
) -> nn.Module:
    """The checkpoint's model in eval mode on `device` in `dtype`, every weight loaded (or random for "dummy")."""
    model_cls = resolve_model_class(checkpoint.hf_config)
    with torch.device(device):
        model = model_cls(arch, backend)
    # Cast before loading: weights are copied (and cast) into place, never held twice on the device.
    model = model.to(dtype=dtype).eval()
    if load_format is LoadFormat.DUMMY:
        fill_dummy_weights(model, seed)
    else:
        model.load_weights(checkpoint.iter_weights())
    return model
