"""Weight loading: sharded checkpoints, strict names, dtype/device moves after construction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.errors import UnsupportedModelError
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class
from tests.models.helpers import assert_logits_close, load_ours, load_reference, run_schedule


def _seqs(vocab: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {0: torch.randint(0, vocab, (9,), generator=gen), 1: torch.randint(0, vocab, (5,), generator=gen)}


_SCHEDULE = [[(0, 6), (1, 5)], [(0, 3)]]


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # tied and untied heads
def test_sharded_safetensors_give_identical_logits(
    family: str, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = tiny_checkpoints[family]
    load_reference(path).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2, "expected the checkpoint to be split"
    whole, sharded = load_ours(path), load_ours(tmp_path)
    seqs = _seqs(whole.arch.vocab_size)
    a, b = run_schedule(whole, seqs, _SCHEDULE), run_schedule(sharded, seqs, _SCHEDULE)
    for seq_id in seqs:
        assert torch.equal(a[seq_id], b[seq_id])


def _fresh_model(path: Path) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]]:
    ckpt = open_checkpoint(str(path), torch.float32)
    arch = ModelArchConfig.from_hf(ckpt.hf_config, None)
    return resolve_model_class(ckpt.hf_config)(arch, TorchAttentionBackend()), list(ckpt.iter_weights())


def test_unexpected_weight_name_is_named(tiny_checkpoints: dict[str, Path]) -> None:
    model, weights = _fresh_model(tiny_checkpoints["llama"])
    weights.append(("model.layers.0.self_attn.rogue_proj.weight", torch.randn(4, 4)))
    with pytest.raises(UnsupportedModelError, match=r"rogue_proj\.weight"):
        model.load_weights(weights)


@pytest.mark.parametrize(
    "dropped", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
)
def test_missing_weight_is_named_with_its_checkpoint_name(dropped: str, tiny_checkpoints: dict[str, Path]) -> None:
    model, weights = _fresh_model(tiny_checkpoints["qwen2"])
    weights = [(n, t) for n, t in weights if n != dropped]
    with pytest.raises(UnsupportedModelError, match="missing 1 weight") as info:
        model.load_weights(weights)
    assert dropped in str(info.value)


def test_missing_qwen2_qkv_bias_is_reported(tiny_checkpoints: dict[str, Path]) -> None:
    model, weights = _fresh_model(tiny_checkpoints["qwen2"])
    weights = [(n, t) for n, t in weights if not n.endswith("v_proj.bias")]
    with pytest.raises(UnsupportedModelError, match=r"v_proj\.bias"):
        model.load_weights(weights)


def test_wrong_shape_and_duplicates_are_refused(tiny_checkpoints: dict[str, Path]) -> None:
    model, weights = _fresh_model(tiny_checkpoints["llama"])
    name, tensor = next((n, t) for n, t in weights if n.endswith("q_proj.weight"))
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([(name, tensor[:-1])])
    model, weights = _fresh_model(tiny_checkpoints["llama"])
    with pytest.raises(UnsupportedModelError, match="twice"):
        model.load_weights([*weights, weights[0]])


def test_inv_freq_and_tied_lm_head_copies_are_ignored(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama3"]  # tied
    model, weights = _fresh_model(path)
    embed = next(t for n, t in weights if n == "model.embed_tokens.weight")
    extras = [("lm_head.weight", embed.clone()), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.rand(12))]
    model.load_weights([*weights, *extras])
    reference = load_ours(path)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_state_dict_has_no_rope_tables_and_packed_names(tiny_checkpoints: dict[str, Path]) -> None:
    names = set(load_ours(tiny_checkpoints["qwen3"]).state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert not any("cos_cache" in n or "sin_cache" in n for n in names)
    assert "lm_head.weight" not in names  # tied


def test_to_bfloat16_after_loading_tracks_float32(tiny_checkpoints: dict[str, Path]) -> None:
    """model.to(dtype=bf16) casts parameters and rope tables; outputs stay near the fp32 ones."""
    path = tiny_checkpoints["llama3"]
    fp32 = load_ours(path)
    bf16 = load_ours(path).to(dtype=torch.bfloat16)
    assert bf16.rotary_emb.cos_cache.dtype == torch.bfloat16
    seqs = _seqs(fp32.arch.vocab_size)
    a, b = run_schedule(fp32, seqs, _SCHEDULE), run_schedule(bf16, seqs, _SCHEDULE)
    for seq_id in seqs:
        assert b[seq_id].dtype == torch.bfloat16
        assert_logits_close(b[seq_id].float(), a[seq_id], rel=0.1)


def test_built_under_bf16_default_dtype_keeps_float32_rope_tables(tiny_checkpoints: dict[str, Path]) -> None:
    ckpt = open_checkpoint(str(tiny_checkpoints["qwen3"]), torch.bfloat16)
    arch = ModelArchConfig.from_hf(ckpt.hf_config, None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = resolve_model_class(ckpt.hf_config)(arch, TorchAttentionBackend())
    finally:
        torch.set_default_dtype(previous)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary_emb.cos_cache.dtype == torch.float32
    model.load_weights(ckpt.iter_weights())
    fp32 = load_ours(tiny_checkpoints["qwen3"])
    seqs = _seqs(arch.vocab_size)
    a, b = run_schedule(fp32, seqs, _SCHEDULE), run_schedule(model, seqs, _SCHEDULE)
    for seq_id in seqs:
        assert_logits_close(b[seq_id].float(), a[seq_id], rel=0.1)
