"""Building an encoder model (BERT, `models.base.EncoderModel`) on its device and filling its weights, from a
Hugging Face checkpoint or at random (`load_format="dummy"`).

The encoder's counterpart of loader.py's `load_model`, without what encoders do not take: tensor parallelism,
quantization, GGUF files, KV-cache scales. The model comes back with its attention on the torch twin; the
caller turns the Triton kernels on (`layers.fusion.use_fused_kernels`) where it takes the Triton attention
backend, as the worker does for decoders. Knows nothing of batching or the engine.
"""

from __future__ import annotations

import torch

from asyncllm.config import LoadFormat
from asyncllm.errors import UnsupportedModelError
from asyncllm.layers import host_heap
from asyncllm.layers.param_dtype import parameters_in
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.dummy import fill_dummy_weights
from asyncllm.model_loader.progress import with_progress
from asyncllm.models.base import EncoderModel
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_architecture


def load_encoder(
    checkpoint: Checkpoint,
    arch: ModelArchConfig,
    device: torch.device,
    dtype: torch.dtype,
    load_format: LoadFormat,
    seed: int,
) -> EncoderModel:
    """The checkpoint's encoder in eval mode on `device` in `dtype`, every weight loaded (or random)."""
    model_cls = resolve_architecture(arch.architecture).model_class
    if not issubclass(model_cls, EncoderModel):
        raise UnsupportedModelError(f"{arch.architecture} is a decoder: model_loader.loader.load_model builds it")
    if device.type == "cpu":
        host_heap.for_load()
    with torch.device(device), parameters_in(dtype):
        model = model_cls(arch)
    model = model.to(dtype=dtype).eval()
    if load_format is LoadFormat.DUMMY:
        fill_dummy_weights(model, seed)
    else:
        model.load_weights(with_progress(checkpoint.iter_weights(), checkpoint.num_tensors))
    if device.type == "cpu":
        host_heap.for_serving()
    return model
