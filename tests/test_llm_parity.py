"""Greedy output of the whole engine equals transformers `generate`, token for token (float32, CPU).

Each family runs batches of mixed prompt lengths, then the same batch again under engine settings that
force chunked prefill, preemption and prefix-cache hits: the schedule must never change the tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams

MAX_NEW = 10
ENGINE_VARIANTS = {
    "plain": dict(block_size=4, num_kv_blocks=512),
    "chunked": dict(block_size=4, num_kv_blocks=512, max_num_batched_tokens=7),
    "preempt": dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16),  # preempts with windows too
    "few_seqs": dict(block_size=8, num_kv_blocks=256, max_num_seqs=2),
}


def _prompts(seed: int, vocab: int, shared_prefix: bool = False) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(13)] if shared_prefix else []
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 9, 30, 3)]


def _hf_greedy(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # compare whole continuations, as with ignore_eos
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def expected(tiny_checkpoints: dict[str, Path]) -> dict[tuple[str, bool], list[list[int]]]:
    return {}


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_greedy_equals_transformers(family: str, variant: str, tiny_checkpoints, expected) -> None:
    path = tiny_checkpoints[family]
    shared = variant in ("preempt", "plain")
    key = (family, shared)
    llm = LLM(str(path), device="cpu", dtype="float32", **ENGINE_VARIANTS[variant])
    prompts = _prompts(1, llm.runtime.vocab_size, shared_prefix=shared)
    if key not in expected:
        expected[key] = _hf_greedy(path, prompts, MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected[key]
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if variant == "preempt":
        assert stats["num_preemptions"] > 0, "the variant must actually preempt"
    llm.shutdown()


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "mistral_swa"])
def test_prefix_cache_hits_keep_outputs(family: str, tiny_checkpoints) -> None:
    """The same shared-prefix batch twice: the second pass hits the cache and gives the same tokens (also
    for sliding-window models, whose prompts and outputs run past their 8-key window)."""
    path = tiny_checkpoints[family]
    llm = LLM(str(path), device="cpu", block_size=4, num_kv_blocks=256)
    prompts = _prompts(2, llm.runtime.vocab_size, shared_prefix=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == second == _hf_greedy(path, prompts, MAX_NEW)
    assert llm.stats()["prefix_cache_hit_rate"] > 0.3
    outs = llm.generate(prompts[:1], params, use_tqdm=False)
    assert outs[0].metrics is not None and outs[0].metrics.num_cached_tokens > 0


def test_results_in_prompt_order_and_text(tiny_checkpoints) -> None:
    path = tiny_checkpoints["qwen3"]
    llm = LLM(str(path), device="cpu")
    outs = llm.generate(
        ["Hello world", "The capital of France is", "日本語"], SamplingParams(temperature=0, max_tokens=8)
    )
    assert [o.prompt_token_ids for o in outs] == [
        llm.tokenizer(p).input_ids for p in ["Hello world", "The capital of France is", "日本語"]
    ]
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.metrics is not None and o.metrics.time_to_first_token is not None


def test_sliding_window_blocks_are_given_back(tiny_checkpoints) -> None:
    """Every layer of the Mistral model slides over 8 keys, so a sequence's blocks behind its window go back
    to the pool while it runs. Four 40-token sequences would need 40 blocks of 4 tokens without that: in 24 they
    run without a single preemption, and give transformers' tokens."""
    path = tiny_checkpoints["mistral_swa"]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, llm.runtime.vocab_size) for _ in range(20)] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == _hf_greedy(path, prompts, 20)
    stats = llm.stats()
    assert stats["num_preemptions"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 24
    llm.shutdown()
