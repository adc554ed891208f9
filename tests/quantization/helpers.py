"""Loading a quantized checkpoint into our model (the engine's loader, on CPU) and reading back each checkpoint
linear layer's dequantized weight through the quantized layers' public tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.config import LoadFormat
from asyncllm.kernels.quant_matmul_ref import dequantize_ref
from asyncllm.layers.linear import Packed
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.model_loader.loader import load_model
from asyncllm.models.config import ModelArchConfig
from asyncllm.quantization.linear import QuantLinear
from asyncllm.quantization.scheme import resolve_quantization


def load_quantized(path: Path, requested: str | None = None) -> nn.Module:
    ckpt = open_checkpoint(str(path), torch.float32)
    arch = ModelArchConfig.from_hf(ckpt.hf_config, None)
    quant = resolve_quantization(requested, getattr(ckpt.hf_config, "quantization_config", None), "cpu")
    backend = TorchAttentionBackend()
    return load_model(ckpt, arch, backend, torch.device("cpu"), torch.float32, LoadFormat.AUTO, 0, None, quant)


def dequantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{checkpoint weight name: float32 [N, K]} for every quantized layer, packed ones split by shard."""
    packed = {ours: ckpt for ckpt, ours in model.family.weights.packed.items()}
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        w = dequantize_ref(
            module.qweight,
            module.scales,
            module.qzeros,
            bits=module.bits,
            group_size=module.group_size,
            mins=module.mins,
        )
        parent, _, attr = name.rpartition(".")
        if isinstance(module, Packed):
            for shard in module.shard_sizes:
                out[f"{parent}.{packed[(attr, shard)]}.weight"] = w[module.shard_rows(shard)]
        else:
            out[f"{name}.weight"] = w
    return out
