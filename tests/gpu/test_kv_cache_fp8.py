"""kv_cache_dtype="fp8" on the GPU: CUDA graphs against eager, overlapped against serial scheduling and the prefix
cache on against off, all over an e4m3 cache in bfloat16 (the same greedy tokens: the same kernels at the same
sizes); the Triton kernels (fused KV write, paged reads) against the torch reference in float32; bfloat16
log-probabilities within e4m3's tolerance of the model-dtype cache (the bound of tests/test_kv_cache_fp8.py)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.fixtures.envs import serial_llm
from tests.test_kv_cache_fp8 import assert_within_e4m3, largest_logit, make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FP8 = dict(device="cuda", kv_cache_dtype="fp8", block_size=4, max_num_seqs=40)


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [
        ([*shared] if i % 3 == 0 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))]
        for i in range(37)
    ]
    return prompts, [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(37)]


def _tokens(path: Path, serial: bool = False, **engine_args: Any) -> tuple[list[list[int]], dict[str, Any]]:
    llm = serial_llm(str(path), **engine_args) if serial else LLM(str(path), **engine_args)
    try:
        prompts, params = _workload(llm.runtime.vocab_size)
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return tokens, stats


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # gemma3: sliding windows inside the graphs
@pytest.mark.parametrize(
    "engine_args", [dict(num_kv_blocks=512), dict(num_kv_blocks=40, max_num_batched_tokens=64)], ids=["roomy", "tight"]
)
def test_graphs_scheduling_and_prefix_cache_variants_agree(tiny_checkpoints, family: str, engine_args: dict) -> None:
    path = tiny_checkpoints[family]
    args = dict(FP8, dtype="bfloat16", **engine_args)
    graphs, stats = _tokens(path, **args)
    assert stats["prefix_cache_hit_rate"] > 0
    if "max_num_batched_tokens" in engine_args:
        assert stats["num_preemptions"] > 0
    variants: list[dict[str, Any]] = [dict(enforce_eager=True), dict(serial=True)]
    if "max_num_batched_tokens" not in engine_args:
        # Not under preemption: there, with the prefix cache off a preempted request's tokens are recomputed by
        # the prefill kernel, while with it on their cached keys and values (written when the decode kernel's
        # outputs fed the next layers) are reused; the two kernels sum in different orders, so bf16 hidden states
        # differ in their last bits and a random model's greedy tokens part (run 58, tight-qwen3).
        variants.append(dict(enable_prefix_caching=False))
    for variant in variants:
        assert _tokens(path, **args, **variant)[0] == graphs, variant


@pytest.mark.usefixtures("exact_fp32")
@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_triton_equals_torch_backend_in_float32(tiny_checkpoints, family: str) -> None:
    args = dict(FP8, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32)
    triton, _ = _tokens(tiny_checkpoints[family], attention_backend="triton", **args)
    assert triton == _tokens(tiny_checkpoints[family], attention_backend="torch", **args)[0]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_bf16_logprobs_within_e4m3_tolerance(tiny_checkpoints, family: str) -> None:
    path, prompts = tiny_checkpoints[family], make_prompts()
    scored = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_dtype=kv, block_size=16, num_kv_blocks=64)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
        scored[kv] = [
            float(getattr(lp[tok], "logprob", lp[tok]))
            for out, ids in zip(outs, prompts)
            for tok, lp in zip(ids[1:], (out.prompt_logprobs or [])[1:])
            if lp is not None
        ]
    assert_within_e4m3(scored["fp8"], scored["auto"], largest_logit(path, prompts))
