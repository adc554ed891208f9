"""ASYNCLLM_DECODE_FOLD_REDUCE on the GPU (bench/gpu_check.sh runs it; skipped without CUDA): an engine whose decode
graphs fold the reduce into the split kernel gives the greedy tokens of one running the separate reduce launch
(float32; five sequences of 150-430 keys under a 512-key bound, so every decode step splits, 1 to 5 live
sequences crossing captured sizes). The kernel's own race and graph-replay checks:
tests/kernels/test_paged_attention_fold.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.usefixtures("exact_fp32")
def test_fold_gives_the_tokens_of_the_reduce_launch(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = []
    for fold in ("1", "0"):
        monkeypatch.setenv("ASYNCLLM_DECODE_FOLD_REDUCE", fold)
        llm = LLM(str(tiny_model), device="cuda", dtype="float32", max_model_len=512)
        try:
            rng, vocab = random.Random(3), llm.runtime.vocab_size  # the same prompts for both engines
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(150, 400))] for _ in range(5)]
            params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(5)]
            outputs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
