"""ASYNCLLM_DECODE_GEMV on the GPU (bench/gpu_check.sh runs them; skipped without CUDA): batch-1 decode steps replaying
graphs that captured the GEMV give the tokens of eager steps launching it (float32 and bfloat16), and in float32
those of the GEMV off ("on" folds the norms and SiLU-and-mul into it too); "auto" times real decode shapes
(Qwen3-0.6B's, the folded pairs included) at start-up and decodes; PDL launches give the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.fixtures.tiny_models import widened_to_qwen3_06b
from tests.worker.test_decode_gemv import LINEARS_PER_LAYER, _prompts, _tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("exact_fp32")
def test_graphs_equal_eager_with_the_gemv_on(tiny_model: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch-1 decode steps replay graphs that captured the GEMV; eager steps launch it: the same tokens."""
    common = dict(device="cuda", dtype=dtype, block_size=4, num_kv_blocks=256)
    batches = [_prompts(300, (9,)), _prompts(300, (4, 13))]
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "on")
    graphs, layers = _tokens(tiny_model, batches, **common)
    eager, _ = _tokens(tiny_model, batches, enforce_eager=True, **common)
    assert graphs == eager and layers == 2 * LINEARS_PER_LAYER
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "off")
    off, _ = _tokens(tiny_model, batches, **common)
    if dtype == "float32":
        assert graphs == off


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs Hopper or newer"
)
def test_pdl_launches_give_the_same_tokens(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ASYNCLLM_DECODE_PDL: the GEMV (its folded norms and SiLU-and-mul too, its weights asked of L2 before the
    wait: the tiny model's fit), RMSNorm, the q/k norm + rotary + KV write and the decode attention launched as
    programmatic dependents, in captured graphs and eagerly: the tokens of plain launches."""
    common = dict(device="cuda", dtype="bfloat16", block_size=4, num_kv_blocks=256)
    batches = [_prompts(300, (9,)), _prompts(300, (4, 13))]
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "on")
    plain, _ = _tokens(tiny_model, batches, **common)
    monkeypatch.setenv("ASYNCLLM_DECODE_PDL", "1")
    pdl, _ = _tokens(tiny_model, batches, **common)
    eager, _ = _tokens(tiny_model, batches, enforce_eager=True, **common)
    assert pdl == plain and eager == plain


def test_auto_times_real_decode_shapes(tiny_model: Path, tmp_path: Path) -> None:
    """Two layers of Qwen3-0.6B's shapes (random weights, the tiny tokenizer), bfloat16 with CUDA graphs:
    "auto" times each shape at start-up (within the tune_gemm phase) and decodes; a shape's choice covers
    all its layers."""
    path = widened_to_qwen3_06b(tiny_model, tmp_path / "wide")
    llm = LLM(str(path), device="cuda", dtype="bfloat16", load_format="dummy", num_kv_blocks=64)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 6
        assert llm.runtime.gemv_layers % 2 == 0  # both layers of a shape, or neither
        assert llm.runtime.prologue_layers % 2 == 0  # likewise for a folded pair (timed once for both layers)
        assert dict(llm.runtime.startup_seconds)["tune_gemm"] < 3.0  # compiling the GEMV (a cold cache) included
    finally:
        llm.shutdown()
