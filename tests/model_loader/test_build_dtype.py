"""The loader builds a model's parameters directly in the serving dtype (a bfloat16 30B model never exists in
float32 first), and the result is exactly what building in float32 and casting gave: the same weights, the
same buffers (rotary tables and scales are still computed in float32 and rounded once)."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.config import LoadFormat
from asyncllm.layers.param_dtype import parameters_in
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.model_loader.loader import load_model
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class

FAMILIES = ["qwen3", "llama3", "gemma3", "qwen3_moe"]


def _open(path):
    ckpt = open_checkpoint(str(path), torch.float32)
    return ckpt, ModelArchConfig.from_hf(ckpt.hf_config, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_parameters_are_allocated_in_the_serving_dtype(family: str, tiny_checkpoints) -> None:
    ckpt, arch = _open(tiny_checkpoints[family])
    with parameters_in(torch.bfloat16):
        model = resolve_model_class(ckpt.hf_config)(arch, TorchAttentionBackend())
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}, dtypes
    outside = resolve_model_class(ckpt.hf_config)(arch, TorchAttentionBackend())
    assert {p.dtype for p in outside.parameters()} == {torch.get_default_dtype()}  # the context ended


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_load_equals_float32_load_cast(family: str, tiny_checkpoints) -> None:
    ckpt, arch = _open(tiny_checkpoints[family])
    cpu = torch.device("cpu")
    bf16 = load_model(ckpt, arch, TorchAttentionBackend(), cpu, torch.bfloat16, LoadFormat.AUTO, 0)
    ckpt, arch = _open(tiny_checkpoints[family])
    cast = load_model(ckpt, arch, TorchAttentionBackend(), cpu, torch.float32, LoadFormat.AUTO, 0).to(torch.bfloat16)
    for kind in ("named_parameters", "named_buffers"):
        got, want = dict(getattr(bf16, kind)()), dict(getattr(cast, kind)())
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
