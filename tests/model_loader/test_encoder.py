"""model_loader/encoder.py: an encoder built on its device in its dtype, from a checkpoint or at random; and
each loader refusing the other kind of model by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.config import LoadFormat
from asyncllm.errors import UnsupportedModelError
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.model_loader.encoder import load_encoder
from asyncllm.model_loader.loader import load_model
from asyncllm.models.bert import BertForSequenceClassification
from asyncllm.models.config import ModelArchConfig
from tests.fixtures.tiny_encoders import build_bert_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_checkpoint(tmp_path_factory.mktemp("cross"), "BertForSequenceClassification", num_labels=2)


def _open(path: Path) -> tuple[Checkpoint, ModelArchConfig]:
    ckpt = open_checkpoint(str(path), torch.float32)
    return ckpt, ModelArchConfig.from_hf(ckpt.hf_config, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights_need_only_the_config(cross_encoder: Path, dtype: torch.dtype) -> None:
    """`load_format="dummy"` (benchmarks): random weights of the real shape in the asked dtype, repeatable
    by seed, never zero."""
    ckpt, arch = _open(cross_encoder)
    models = [load_encoder(ckpt, arch, CPU, dtype, LoadFormat.DUMMY, seed) for seed in (0, 0, 1)]
    assert isinstance(models[0], BertForSequenceClassification) and not models[0].training
    weights = [m.classifier.weight for m in models]
    assert all(w.dtype == dtype and w.shape == (2, 32) and w.abs().sum() > 0 for w in weights)
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_the_checkpoint_weights_are_loaded(cross_encoder: Path) -> None:
    from safetensors.torch import load_file

    ckpt, arch = _open(cross_encoder)
    model = load_encoder(ckpt, arch, CPU, torch.float32, LoadFormat.AUTO, 0)
    stored = load_file(cross_encoder / "model.safetensors")
    assert torch.equal(model.classifier.weight, stored["classifier.weight"])
    assert torch.equal(model.pooler.dense.bias, stored["bert.pooler.dense.bias"])


def test_each_loader_refuses_the_other_kind(cross_encoder: Path, tiny_checkpoints: dict[str, Path]) -> None:
    ckpt, arch = _open(cross_encoder)
    with pytest.raises(UnsupportedModelError, match="BertForSequenceClassification is an encoder"):
        load_model(ckpt, arch, TorchAttentionBackend(), CPU, torch.float32, LoadFormat.AUTO, 0)
    ckpt, arch = _open(tiny_checkpoints["qwen3"])
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM is a decoder"):
        load_encoder(ckpt, arch, CPU, torch.float32, LoadFormat.AUTO, 0)
