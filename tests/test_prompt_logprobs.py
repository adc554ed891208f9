"""`SamplingParams(prompt_logprobs=k)` through the whole engine equals a float32 transformers forward pass's
log_softmax at every prompt position, however the prompt is scheduled: in one step, in chunks (a chunk's last
row scores the next chunk's first token), in slices of the LM head, after a preemption (no position twice),
beside a cached prefix (not taken: every position is computed), and once per request with n samples."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncllm import LLM, AsyncLLMEngine, SamplingParams

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": dict(block_size=4, num_kv_blocks=256),
    "chunked": dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=7),
    "sliced": dict(block_size=8, num_kv_blocks=256, max_num_seqs=2),  # the LM head on 2 rows at a time
    # preempts requests halfway through their prompts: recomputed, their scored positions are not scored again
    "preempt": dict(block_size=4, num_kv_blocks=10, max_num_batched_tokens=6),
}
K = 3


def _reference(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()

    def logprobs(ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return logprobs


def _check(prompt: list[int], got: list[dict[int, float] | None] | None, want: torch.Tensor, k: int) -> None:
    assert got is not None and len(got) == len(prompt), "one entry per prompt token, none twice"
    assert got[0] is None
    for i in range(1, len(prompt)):
        entry = got[i]
        assert entry is not None
        top_ids = want[i - 1].topk(k).indices
        assert set(entry) == {prompt[i], *top_ids.tolist()}  # the prompt token and the top k
        for token, value in entry.items():
            assert abs(value - want[i - 1, token].item()) < 1e-5, (i, token)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 2, 17, 9, 30)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prompt_logprobs_equal_transformers(variant: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["qwen3"]
    llm = LLM(str(path), device="cpu", dtype="float32", **VARIANTS[variant])
    prompts = _prompts(llm.runtime.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(prompts, params, use_tqdm=False)
    reference = _reference(path)
    for prompt, out in zip(prompts, outs):
        _check(prompt, out.prompt_logprobs, reference(prompt), K)
        assert len(out.token_ids) == 8
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if variant == "preempt":
        assert stats["num_preemptions"] > 0, "the variant must preempt"
    # Only the prompt token's own logprob, and requests that do not ask get none: in one batch
    mixed = [SamplingParams(max_tokens=2, prompt_logprobs=0), SamplingParams(max_tokens=2)]
    own, none = llm.generate(prompts[2:4], mixed, use_tqdm=False)
    assert none.prompt_logprobs is None and own.prompt_logprobs is not None
    assert [set(e) for e in own.prompt_logprobs[1:]] == [{t} for t in prompts[2][1:]]
    llm.shutdown()


def test_untied_head(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=5)
    prompt = _prompts(llm.runtime.vocab_size, seed=1)[-1]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    _check(prompt, out.prompt_logprobs, _reference(path)(prompt), 1)
    llm.shutdown()


def test_a_cached_prefix_is_not_taken(tiny_checkpoints: dict[str, Path]) -> None:
    """The prompt's blocks are in the prefix cache, yet a request asking for prompt logprobs computes (and
    scores) every position; the next request without them takes the hit as usual."""
    path = tiny_checkpoints["qwen3"]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    prompt = _prompts(llm.runtime.vocab_size, seed=2)[-1]
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], plain, use_tqdm=False)
    (scored,) = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    assert scored.metrics is not None and scored.metrics.num_cached_tokens == 0
    _check(prompt, scored.prompt_logprobs, _reference(path)(prompt), 2)
    (again,) = llm.generate([prompt], plain, use_tqdm=False)
    assert again.metrics is not None and again.metrics.num_cached_tokens > 0  # the cache was there
    llm.shutdown()


def test_n_samples_share_the_prompts_logprobs(tiny_checkpoints: dict[str, Path]) -> None:
    """n samples, a chunked prompt: the prompt is scored once, for the request; every sample still draws."""
    path = tiny_checkpoints["qwen3"]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=8)
    prompt = _prompts(llm.runtime.vocab_size, seed=3)[-1]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    _check(prompt, out.prompt_logprobs, _reference(path)(prompt), K)
    alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=12, max_tokens=4, ignore_eos=True))[0]
    assert [len(o.token_ids) for o in out.outputs] == [4, 4, 4]
    assert out.outputs[1].token_ids == alone.token_ids  # sample 1 draws as a request seeded 11 + 1
    llm.shutdown()


def test_stream_carries_them_once_on_the_first_chunk(tiny_model: Path) -> None:
    async def main() -> list[Any]:
        async with AsyncLLMEngine(str(tiny_model), device="cpu", block_size=4, num_kv_blocks=64) as engine:
            params = SamplingParams(n=2, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
            chunks = [c async for c in engine.stream(list(range(3, 20)), params)]
            whole = await engine.generate(list(range(3, 20)), params)
            return [chunks, whole]

    chunks, whole = asyncio.run(main())
    assert chunks[0].prompt_logprobs is not None and len(chunks[0].prompt_logprobs) == 17
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    assert list(chunks[0].prompt_logprobs) == whole.prompt_logprobs
