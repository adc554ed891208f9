"""Start-up warm-up stays within the engine's own limits (sequences and tokens per step, KV blocks, model
length), however small, and leaves no per-request state behind."""

from __future__ import annotations

import itertools

import pytest
import torch

from asyncllm.config import EngineConfig
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.setup import build_worker
from asyncllm.worker.warmup import warm_up


@pytest.mark.parametrize(
    ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size"),
    list(itertools.product([1, 2, 256], [1, 8, 32, 8192], [1, 6, 64], [1, 16])),
)
def test_warm_up_fits_any_engine(tiny_model, max_num_seqs, max_num_batched_tokens, num_kv_blocks, block_size) -> None:
    """Regression: warm-up prompts longer than max_num_batched_tokens overflowed the input buffers."""
    config = EngineConfig.from_kwargs(
        str(tiny_model),
        device="cpu",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=64,
    )
    checkpoint = open_checkpoint(str(tiny_model), torch.float32)
    worker = build_worker(config, checkpoint, ResolvedModel.resolve(config, checkpoint.hf_config))
    assert worker.runner is not None
    warm_up(
        worker.runner,
        block_size=block_size,
        num_blocks=num_kv_blocks,
        max_model_len=64,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert not worker.runner.states
