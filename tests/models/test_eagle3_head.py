"""The EAGLE-3 pieces' maths against independent references: the hidden states a target copies out
(models/aux_hidden.py) are transformers' `output_hidden_states` (id j: the input of layer j), and the head
(models/eagle3.py) loaded from a head saved as the published ones are matches the EAGLE-3 formula written
out here in plain torch over a whole sequence, run through a paged cache in two chunks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.models.aux_hidden import AuxHidden
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.eagle3 import Eagle3Head
from tests.fixtures.eagle3_heads import build_eagle3_head
from tests.fixtures.paged import PagedBatcher
from tests.models.helpers import load_ours, load_reference

TOKENS = torch.tensor([5, 9, 3, 17, 4, 4, 11, 2, 8, 30, 7])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@torch.no_grad()
def test_captured_hidden_states_are_transformers(tiny_checkpoints: dict[str, Path], name: str) -> None:
    path = tiny_checkpoints[name]
    ours = load_ours(path)
    layers = (0, 1, 1)  # a repeated id fills both places
    aux = AuxHidden(layers, ours.arch.hidden_size, 4, torch.device("cpu"), torch.float32)  # grows to the pass
    ours.aux_hidden = aux
    batcher = PagedBatcher(num_blocks=16, block_size=4)
    caches = batcher.new_caches(ours.arch.num_layers, ours.arch.num_kv_heads, ours.arch.head_dim, torch.float32)
    positions, meta = batcher.step([(0, len(TOKENS))])
    ours(TOKENS, positions, caches, meta)
    states = load_reference(path)(TOKENS[None], output_hidden_states=True).hidden_states
    expected = torch.cat([states[j][0] for j in layers], dim=-1)
    torch.testing.assert_close(aux.buffer[: len(TOKENS)], expected, rtol=1e-4, atol=1e-5)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotation (halves) of [T, H, D] at positions 0..T-1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv[None]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _reference(t: dict[str, torch.Tensor], cfg: dict, embeds: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """The EAGLE-3 head over one whole sequence: returns (normed, pre-norm) side by side [T, 2 * hidden]."""
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hidden = aux @ t["fc.weight"].T
    x = torch.cat(
        [_rms(embeds, t["midlayer.input_layernorm.weight"]), _rms(hidden, t["midlayer.hidden_norm.weight"])], -1
    )
    n = x.shape[0]
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), cfg["rope_theta"])
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, d), cfg["rope_theta"])
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    h = o @ t["midlayer.self_attn.o_proj.weight"].T + hidden  # the residual: the hidden state before its norm
    m = _rms(h, t["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
    pre = (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T + h
    return torch.cat([_rms(pre, t["norm.weight"]), pre], -1)


@torch.no_grad()
def test_the_head_is_the_eagle3_formula(tiny_model: Path, tmp_path: Path) -> None:
    head_dir = build_eagle3_head(tmp_path / "head", tiny_model, draft_vocab_size=40, with_embedding=True)
    cfg = json.loads((head_dir / "config.json").read_text())
    tensors = load_file(str(head_dir / "model.safetensors"))
    arch = ModelArchConfig.from_hf(type("Config", (), {**cfg, "architectures": ["LlamaForCausalLM"]})(), None)
    head = Eagle3Head(arch, TorchAttentionBackend(), cfg["hidden_size"], 3, 40, True, False, False)
    head.load_weights(tensors.items())
    head.eval()
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(len(TOKENS), 3 * cfg["hidden_size"], generator=gen)
    assert head.embed_tokens is not None
    embeds = head.embed_tokens(TOKENS)
    batcher = PagedBatcher(num_blocks=16, block_size=4)
    cache = batcher.new_caches(1, arch.num_kv_heads, arch.head_dim, torch.float32)[0]
    outs = []
    for lo, hi in ((0, 6), (6, len(TOKENS))):  # a chunk, then the rest over the cached keys
        positions, meta = batcher.step([(0, hi - lo)])
        normed, pre = head(embeds[lo:hi], head.combine(aux[lo:hi]), positions, cache, meta)
        outs.append(torch.cat([normed, pre], -1))
    expected = _reference(tensors, cfg, embeds, aux)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-4, atol=1e-4)
    h = cfg["hidden_size"]
    drafts = head.draft(expected[:, :h])
    ids = (expected[:, :h] @ tensors["lm_head.weight"].T).argmax(-1)
    assert torch.equal(drafts, ids + tensors["d2t"][ids])  # draft ids mapped to the target's
    assert torch.equal(drafts % (cfg["vocab_size"] // 40), torch.zeros_like(drafts))
