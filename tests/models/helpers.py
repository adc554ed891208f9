"""Shared helpers for model tests: build our model from a checkpoint, run step schedules, load references."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class
from tests.fixtures.paged import PagedBatcher

Schedule = list[list[tuple[int, int]]]  # steps, each a list of (seq_id, new tokens)


def load_ours(path: Path, max_model_len: int | None = None) -> nn.Module:
    ckpt = open_checkpoint(str(path), torch.float32)
    arch = ModelArchConfig.from_hf(ckpt.hf_config, max_model_len)
    model = resolve_model_class(ckpt.hf_config)(arch, TorchAttentionBackend())
    model.load_weights(ckpt.iter_weights())
    return model.eval()


def load_reference(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def reference_logits(hf_model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[L] -> [L, vocab]: one unpadded sequence through transformers; causal, so every prefix's logits."""
    return hf_model(tokens[None]).logits[0]


@torch.no_grad()
def run_schedule(
    model: nn.Module, seqs: dict[int, torch.Tensor], schedule: Schedule, block_size: int = 4, seed: int = 0
) -> dict[int, torch.Tensor]:
    """Feed every sequence through the paged cache step by step; returns each sequence's [L, vocab] logits."""
    arch = model.arch
    batcher = PagedBatcher(num_blocks=64, block_size=block_size, seed=seed)
    dtype = next(model.parameters()).dtype
    caches = batcher.new_caches(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype)
    rows: dict[int, list[torch.Tensor]] = {seq_id: [] for seq_id in seqs}
    for step in schedule:
        starts = [batcher.computed.get(seq_id, 0) for seq_id, _ in step]
        positions, meta = batcher.step(step)
        ids = torch.cat([seqs[s][start : start + n] for (s, n), start in zip(step, starts)])
        logits = model.compute_logits(model(ids, positions, caches, meta))
        for (seq_id, _), chunk in zip(step, logits.split(meta.query_lens_cpu)):
            rows[seq_id].append(chunk)
    out = {seq_id: torch.cat(chunks) for seq_id, chunks in rows.items()}
    for seq_id, logits in out.items():
        assert logits.shape[0] == seqs[seq_id].shape[0], "schedule must cover every token"
    return out


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Max abs difference within `rel` of the reference's largest logit."""
    assert ours.shape == ref.shape
    bound = rel * ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= bound, f"max |ours - transformers| = {diff:.3e} > {bound:.3e}"
