"""Qwen3-MoE on the GPU, where its experts run the fused Triton kernel: float32 greedy tokens equal to the torch
reference (and to transformers), CUDA graphs replaying what eager steps compute in both dtypes while the batch
crosses captured sizes (routing differs every step, the graphs' shapes never do), and TP=2 equal to TP=1 in
float32 (skipped with one GPU). Runs on the device machine (bench/gpu_check.sh)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _workload(vocab: int, count: int = 21) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, vocab) for _ in range(24)]
    prompts = [
        ([*shared] if i % 3 == 0 else []) + [rng.randrange(3, vocab) for _ in range(2 + 3 * i)] for i in range(count)
    ]
    return prompts, [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(count)]


def _tokens(path: Path, prompts: list[list[int]], params: list[SamplingParams], **engine_args: Any) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", **engine_args)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        return [o.token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("exact_fp32")
def test_fused_experts_give_the_torch_reference_tokens(tiny_checkpoints) -> None:
    """float32: the Triton backend (fused experts, CUDA graphs) and the torch backend (the reference, eager)
    give the same greedy tokens, chunked prefill forced by the token budget."""
    path = tiny_checkpoints["qwen3_moe"]
    prompts, params = _workload(300)
    args: dict[str, Any] = dict(dtype="float32", block_size=16, num_kv_blocks=256, max_num_batched_tokens=48)
    fused = _tokens(path, prompts, params, attention_backend="triton", **args)
    assert fused == _tokens(path, prompts, params, attention_backend="torch", **args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("exact_fp32")
def test_graphs_replay_what_eager_computes(tiny_checkpoints, dtype: str) -> None:
    """The live batch shrinks through captured sizes 1..16, prompts' steps replay token-count graphs, a small
    cache preempts: graphs and eager steps give the same tokens in both dtypes."""
    path = tiny_checkpoints["qwen3_moe"]
    prompts, params = _workload(300)
    args: dict[str, Any] = dict(dtype=dtype, block_size=4, max_num_seqs=16, num_kv_blocks=60, max_num_batched_tokens=64)
    graphs = _tokens(path, prompts, params, **args)
    assert graphs == _tokens(path, prompts, params, enforce_eager=True, **args)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.usefixtures("exact_fp32")
def test_fp32_tp2_equals_tp1(tiny_checkpoints) -> None:
    """Each rank holds half of every expert's intermediate dimension; one all-reduce per MoE layer."""
    path = tiny_checkpoints["qwen3_moe"]
    prompts, params = _workload(300, count=8)
    args: dict[str, Any] = dict(dtype="float32", block_size=16, num_kv_blocks=256)
    assert _tokens(path, prompts, params, tensor_parallel_size=2, **args) == _tokens(path, prompts, params, **args)
