"""ASYNCLLM_CASCADE_ATTENTION on the GPU (bench/gpu_check.sh runs them; skipped without CUDA): requests sharing a cached
prompt prefix decode through the cascade graphs (each decode bucket captured plain and cascade) with the tokens
of eager steps launching the same kernels (float32 and bfloat16), and in float32 those of cascade off. The
kernel's own bf16/fp16 checks against the plain kernel: tests/kernels/test_paged_attention_cascade.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.test_cascade_attention import PREFIX, shared_prompts, tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("exact_fp32")
def test_graphs_equal_eager_with_cascade_on(tiny_model: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    common = dict(device="cuda", dtype=dtype, block_size=4, num_kv_blocks=512)
    monkeypatch.setenv("ASYNCLLM_CASCADE_ATTENTION", "auto")
    prompts = shared_prompts(300, 12)  # 11 sharing the first one's cached prefix: bucket 16, padded
    graphs, cached = tokens(tiny_model, prompts, **common)
    eager, _ = tokens(tiny_model, prompts, enforce_eager=True, **common)
    assert min(cached) >= PREFIX
    assert graphs == eager
    monkeypatch.setenv("ASYNCLLM_CASCADE_ATTENTION", "off")
    off, _ = tokens(tiny_model, prompts, **common)
    if dtype == "float32":
        assert graphs == off
