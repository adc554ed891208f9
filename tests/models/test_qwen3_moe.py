"""Qwen3-MoE beyond what every family gets from tests/fixtures/tiny_models.py (logits and engine greedy equal to
transformers under chunked prefill, preemption and prefix hits; TP=2 and 4 equal to TP=1): routing without
renormalisation and a sparse step, which layers are dense, strict loading of per-expert tensors, the fused
experts inside the model, and each rank's slices of expert tensors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.errors import InvalidConfigError, UnsupportedModelError
from asyncllm.layers.moe import SparseMoE
from asyncllm.layers.parallel import WeightShard
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class
from asyncllm.models.tensor_parallel import check_tensor_parallel, weight_shard
from tests.fixtures.tiny_models import build_checkpoint
from tests.fixtures.triton_kernels import import_kernel
from tests.models.helpers import assert_logits_close, load_ours, load_reference, reference_logits, run_schedule

_SCHEDULE = [[(0, 4), (1, 9)], [(0, 5), (1, 1), (2, 3)], [(0, 1), (1, 1), (2, 3)], [(0, 1), (2, 1)]]


def _fresh_model(path: Path) -> tuple[CausalLM, list[tuple[str, torch.Tensor]]]:
    """The model built from the checkpoint's config, no weight loaded yet, and the checkpoint's weights."""
    ckpt = open_checkpoint(str(path), torch.float32)
    arch = ModelArchConfig.from_hf(ckpt.hf_config, None)
    return resolve_model_class(ckpt.hf_config)(arch, TorchAttentionBackend()), list(ckpt.iter_weights())


def _seqs(vocab: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {i: torch.randint(0, vocab, (n,), generator=gen) for i, n in enumerate([11, 11, 7])}


def test_unrenormalised_routing_and_sparse_step_match_transformers(tmp_path: Path) -> None:
    """norm_topk_prob=False (the top-k probabilities used as they are) and decoder_sparse_step=2 (layers 0 and 2
    dense): logits equal transformers' through chunked prefill mixed with decodes."""
    path = build_checkpoint(
        tmp_path / "m", "qwen3_moe", norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2
    )
    ours, ref = load_ours(path), load_reference(path)
    assert ours.arch.moe is not None and not ours.arch.moe.renormalize
    assert ours.arch.moe.dense_layers == {0, 2}
    seqs = _seqs(ours.arch.vocab_size)
    got = run_schedule(ours, seqs, _SCHEDULE)
    for seq_id, tokens in seqs.items():
        assert_logits_close(got[seq_id], reference_logits(ref, tokens))


@pytest.mark.parametrize(
    "fields",
    [
        dict(mlp_only_layers=[0, 3]),
        dict(decoder_sparse_step=3),
        dict(decoder_sparse_step=2, mlp_only_layers=[3]),
        dict(num_experts=0),  # no experts: every layer dense
    ],
)
def test_dense_layers_are_those_transformers_builds(fields: dict) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeModel
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    sizes = dict(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_attention_heads=2)
    config = Qwen3MoeConfig(num_hidden_layers=6, num_key_value_heads=1, head_dim=8, vocab_size=32, **sizes, **fields)
    config.architectures = ["Qwen3MoeForCausalLM"]
    layers = Qwen3MoeModel(config).layers
    sparse = {i for i, layer in enumerate(layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)}
    moe = ModelArchConfig.from_hf(config, None).moe
    if not sparse:
        assert moe is None
    else:
        assert moe is not None and set(range(6)) - moe.dense_layers == sparse


@pytest.mark.slow
def test_fused_experts_match_the_torch_form(tiny_checkpoints: dict[str, Path]) -> None:
    """The model with its MoE layers on the Triton kernel (the interpreter on CPU) gives the torch form's
    logits, through chunked prefill and decodes."""
    import_kernel("fused_moe")  # the interpreter without CUDA
    path = tiny_checkpoints["qwen3_moe"]
    plain, fused = load_ours(path), load_ours(path)
    layers = [m for m in fused.modules() if isinstance(m, SparseMoE)]
    assert len(layers) == 2
    for layer in layers:
        layer.enable_fused_kernels()
        assert layer.fused
    seqs = _seqs(plain.arch.vocab_size)
    want, got = run_schedule(plain, seqs, _SCHEDULE), run_schedule(fused, seqs, _SCHEDULE)
    for seq_id in seqs:
        assert_logits_close(got[seq_id], want[seq_id])


# ---------------------------------------------------------------- strict loading of expert tensors


def test_missing_expert_weight_is_named(tiny_checkpoints: dict[str, Path]) -> None:
    model, weights = _fresh_model(tiny_checkpoints["qwen3_moe"])
    dropped = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(UnsupportedModelError, match="missing 1 weight") as info:
        model.load_weights([(n, t) for n, t in weights if n != dropped])
    assert dropped in str(info.value)


def test_expert_beyond_the_config_duplicates_and_shapes_are_refused(tiny_checkpoints: dict[str, Path]) -> None:
    model, weights = _fresh_model(tiny_checkpoints["qwen3_moe"])
    down = dict(weights)["model.layers.0.mlp.experts.0.down_proj.weight"]
    with pytest.raises(UnsupportedModelError, match="belongs to expert 8, but the config has 8 experts"):
        model.load_weights([*weights, ("model.layers.0.mlp.experts.8.down_proj.weight", down)])
    model, weights = _fresh_model(tiny_checkpoints["qwen3_moe"])
    with pytest.raises(UnsupportedModelError, match=r"experts\.0\.down_proj\.weight' appears twice"):
        model.load_weights([*weights, ("model.layers.0.mlp.experts.0.down_proj.weight", down)])
    model, weights = _fresh_model(tiny_checkpoints["qwen3_moe"])
    stacked = torch.zeros(8, *down.shape)  # every expert's down projection at once (GGUF's layout), again
    with pytest.raises(UnsupportedModelError, match="appears twice"):
        model.load_weights([*weights, ("model.layers.0.mlp.experts.down_proj.weight", stacked)])
    model, _ = _fresh_model(tiny_checkpoints["qwen3_moe"])
    with pytest.raises(ValueError, match=r"expert 3: checkpoint shape \(64, 31\)"):
        model.load_weights([("model.layers.0.mlp.experts.3.down_proj.weight", down[:, :31])])


def test_transformers_in_memory_layout_is_not_a_checkpoint_name(tiny_checkpoints: dict[str, Path]) -> None:
    """transformers 5 holds experts fused in memory (mlp.experts.gate_up_proj) but saves them per expert; the
    fused name is not a checkpoint layout, and is refused by name rather than loaded into the wrong rows."""
    model, weights = _fresh_model(tiny_checkpoints["qwen3_moe"])
    fused = torch.zeros(8, 64, 64)
    with pytest.raises(UnsupportedModelError, match=r"mlp\.experts\.gate_up_proj'.*has no place"):
        model.load_weights([*weights, ("model.layers.0.mlp.experts.gate_up_proj", fused)])


# ---------------------------------------------------------------- tensor parallelism


def test_expert_tensors_split_along_each_experts_intermediate_dim(tiny_checkpoints: dict[str, Path]) -> None:
    """Gate/up rows and down columns of every expert (one dimension further in for a stacked tensor); the
    router whole on every rank."""
    model, _ = _fresh_model(tiny_checkpoints["qwen3_moe"])
    arch = model.arch
    for rank in range(2):
        half = (rank * 16, rank * 16 + 16)  # moe_intermediate_size 32 over 2 ranks
        prefix = "model.layers.0.mlp"
        assert weight_shard(f"{prefix}.experts.3.gate_proj.weight", arch, rank, 2) == WeightShard(0, *half, 16)
        assert weight_shard(f"{prefix}.experts.7.up_proj.weight", arch, rank, 2) == WeightShard(0, *half, 16)
        assert weight_shard(f"{prefix}.experts.0.down_proj.weight", arch, rank, 2) == WeightShard(1, *half, 16)
        assert weight_shard(f"{prefix}.experts.gate_proj.weight", arch, rank, 2) == WeightShard(1, *half, 16)
        assert weight_shard(f"{prefix}.experts.down_proj.weight", arch, rank, 2) == WeightShard(2, *half, 16)
        assert weight_shard(f"{prefix}.gate.weight", arch, rank, 2) is None
        dense = (rank * 64, rank * 64 + 64)  # layer 1's dense MLP: intermediate_size 128
        assert weight_shard("model.layers.1.mlp.gate_proj.weight", arch, rank, 2) == WeightShard(0, *dense, 64)


def test_expert_size_that_does_not_divide_is_refused(tiny_checkpoints: dict[str, Path]) -> None:
    model, _ = _fresh_model(tiny_checkpoints["qwen3_moe"])
    arch = model.arch
    assert arch.moe is not None
    odd = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, intermediate_size=30))
    check_tensor_parallel(odd, 2)
    with pytest.raises(InvalidConfigError, match="does not divide the model's moe_intermediate_size=30"):
        check_tensor_parallel(odd, 4)


def test_bad_expert_counts_are_refused(tiny_checkpoints: dict[str, Path]) -> None:
    config = open_checkpoint(str(tiny_checkpoints["qwen3_moe"]), torch.float32).hf_config
    config.num_experts_per_tok = 9
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        ModelArchConfig.from_hf(config, None)
