"""RoPE tables and rotation against transformers' own functions, bit for bit in float32."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from asyncllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from asyncllm.models.config import ModelArchConfig

_LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def _config(head_dim: int, rope: dict | None) -> transformers.LlamaConfig:
    kwargs = dict(rope_parameters=rope) if rope else {}
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=2048,
        **kwargs,
    )


@pytest.mark.parametrize("head_dim", [16, 24, 128])
@pytest.mark.parametrize("rope", [None, _LLAMA3], ids=["default", "llama3"])
def test_tables_equal_transformers(head_dim: int, rope: dict | None) -> None:
    cfg = _config(head_dim, rope)
    arch = ModelArchConfig.from_hf(cfg, None)
    ours = RotaryEmbedding(head_dim, 2048, arch.rope_theta, arch.rope_scaling)
    theirs = LlamaRotaryEmbedding(cfg)
    if rope:  # the llama3 rescaling must actually change some frequencies for this test to mean anything
        expected_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, None)
        assert torch.equal(rope_inv_freq(head_dim, arch.rope_theta, arch.rope_scaling), expected_inv)
        assert not torch.equal(expected_inv, rope_inv_freq(head_dim, arch.rope_theta, None))
    positions = torch.randint(0, 2048, (37,))
    x = torch.randn(1, 37, 8)
    cos_ref, sin_ref = theirs(x, positions[None])  # [1, T, D]
    cos, sin = ours(positions)  # [T, D/2]
    assert torch.equal(torch.cat((cos, cos), -1), cos_ref[0])
    assert torch.equal(torch.cat((sin, sin), -1), sin_ref[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_apply_rotary_equals_rotate_half_form(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(24, 256, 10000.0, None)
    positions = torch.randint(0, 256, (11,))
    cos, sin = rope(positions)
    q = torch.randn(11, 4, 24).to(dtype)
    k = torch.randn(11, 2, 24).to(dtype)
    full_cos = torch.cat((cos, cos), -1).to(dtype)[None]  # [1, T, D], transformers' layout
    full_sin = torch.cat((sin, sin), -1).to(dtype)[None]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos, full_sin)
    assert torch.equal(apply_rotary(q, cos, sin), q_ref[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), k_ref[0].transpose(0, 1))


def test_rotation_preserves_norm_and_is_relative() -> None:
    """q·k after rotation depends only on the position difference."""
    rope = RotaryEmbedding(16, 64, 10000.0, None)
    q, k = torch.randn(1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 16, dtype=torch.float64)

    def dot(pq: int, pk: int) -> float:
        cq, sq = rope(torch.tensor([pq]))
        ck, sk = rope(torch.tensor([pk]))
        return (apply_rotary(q, cq.double(), sq.double()) * apply_rotary(k, ck.double(), sk.double())).sum().item()

    assert dot(10, 3) == pytest.approx(dot(40, 33), rel=1e-5)
    cq, sq = rope(torch.tensor([17]))
    assert apply_rotary(q, cq.double(), sq.double()).norm().item() == pytest.approx(q.norm().item(), rel=1e-6)
