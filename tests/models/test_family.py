"""A family's `FamilySpec`: its numerics variation points are applied only when set (the defaults are the
parity-tested Llama numbers), and its weight plan alone decides how tensors are sharded and named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.family import EmbeddingScale, GGUFNames, Split, WeightPlan
from asyncllm.models.llama import LLAMA_WEIGHTS, LlamaForCausalLM
from asyncllm.models.registry import ARCHITECTURES
from asyncllm.models.tensor_parallel import weight_shard
from tests.models.helpers import run_schedule


def _load(cls: type[LlamaForCausalLM], path: Path, **arch_changes: float) -> LlamaForCausalLM:
    ckpt = open_checkpoint(str(path), torch.float32)
    arch = dataclasses.replace(ModelArchConfig.from_hf(ckpt.hf_config, None), **arch_changes)
    model = cls(arch, TorchAttentionBackend())
    model.load_weights(ckpt.iter_weights())
    return model.eval()


def _layer0_input(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """What the first decoder layer receives: the embeddings, scaled or not."""
    seen: list[torch.Tensor] = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    try:
        run_schedule(model, {0: ids}, [[(0, ids.shape[0])]])
    finally:
        handle.remove()
    return seen[0]


def test_embedding_scale_multiplies_by_sqrt_hidden(tiny_checkpoints: dict[str, Path]) -> None:
    class Scaled(LlamaForCausalLM):
        family = dataclasses.replace(LlamaForCausalLM.family, embedding_scale=EmbeddingScale.SQRT_HIDDEN)

    path = tiny_checkpoints["llama"]
    plain, scaled = _load(LlamaForCausalLM, path), _load(Scaled, path)
    assert plain.embed_scale is None and "embed_scale" not in plain.state_dict()
    ids = torch.arange(5)
    expected = _layer0_input(plain, ids) * torch.tensor(plain.arch.hidden_size**0.5)
    torch.testing.assert_close(_layer0_input(scaled, ids), expected, atol=0, rtol=0)


def test_final_logit_softcap_applies_only_when_set(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama3"]  # tied head
    plain, capped = _load(LlamaForCausalLM, path), _load(LlamaForCausalLM, path, final_logit_softcapping=2.0)
    hidden = torch.randn(3, plain.arch.hidden_size)
    logits = plain.compute_logits(hidden)
    torch.testing.assert_close(capped.compute_logits(hidden), torch.tanh(logits / 2.0) * 2.0, atol=0, rtol=0)


def test_attention_scale_from_query_pre_attn_scalar(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]
    plain, scaled = _load(LlamaForCausalLM, path), _load(LlamaForCausalLM, path, query_pre_attn_scalar=9.0)
    head_dim = plain.arch.head_dim
    assert plain.model.layers[0].self_attn.attn.scale == head_dim**-0.5  # unchanged bits by default
    assert scaled.model.layers[0].self_attn.attn.scale == 9.0**-0.5


def test_weight_shard_reads_only_the_plan() -> None:
    """A family with other checkpoint names is sharded by its own plan; the default is the registry's."""
    arch = ModelArchConfig("LlamaForCausalLM", vocab_size=10, hidden_size=8, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=2, intermediate_size=12, rms_norm_eps=1e-6, rope_theta=1e4,
                           rope_scaling=None, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                           max_position_embeddings=16, max_model_len=16)  # fmt: skip
    other = WeightPlan(
        packed={"wq": ("wqkv", "q")},
        column_parallel={"wq": Split.QUERY_HEADS, "w1": Split.INTERMEDIATE},
        row_parallel={"wo": Split.QUERY_HEADS},
        embedding="tok_embeddings",
        lm_head="output",
    )
    assert weight_shard("layers.0.attention.wq.weight", arch, 1, 2, other) == weight_shard(
        "model.layers.0.self_attn.q_proj.weight", arch, 1, 2
    )
    assert weight_shard("layers.0.feed_forward.w1.weight", arch, 1, 2, other).start == 6
    assert weight_shard("layers.0.attention.wo.weight", arch, 0, 2, other).dim == 1
    assert weight_shard("output.weight", arch, 1, 2, other).size == 5
    assert weight_shard("model.layers.0.self_attn.q_proj.weight", arch, 1, 2, other) is None  # not its name
    assert weight_shard("model.layers.0.self_attn.q_proj.weight", arch, 1, 2, LLAMA_WEIGHTS) is not None


def test_row_parallel_modules_cannot_be_packed() -> None:
    with pytest.raises(ValueError, match="row-parallel modules \\['o_proj'\\] cannot be packed"):
        dataclasses.replace(LLAMA_WEIGHTS, packed={**LLAMA_WEIGHTS.packed, "o_proj": ("qkvo_proj", "o")})


def test_every_gguf_name_lands_on_a_checkpoint_name_of_its_family(tiny_checkpoints: dict[str, Path]) -> None:
    """The GGUF tables point at names the family's checkpoints really have (Qwen3's q/k norms included)."""
    for family in ("llama", "qwen3"):
        ckpt = open_checkpoint(str(tiny_checkpoints[family]), torch.float32)
        names = {name for name, _ in ckpt.iter_weights()}
        arch = next(a for a in ARCHITECTURES if a.name == ckpt.hf_config.architectures[0])
        gguf: GGUFNames = arch.gguf_names
        modules = {n.rpartition(".")[0] for n in names}
        for hf in gguf.globals.values():
            assert hf in modules or hf == "lm_head", (family, hf)  # tied checkpoints have no head
        for hf in gguf.blocks.values():
            assert f"{gguf.layers}.0.{hf}" in modules, (family, hf)
