"""The start-up GEMM choices kept on disk (worker/tuning_cache.py) on the GPU: an engine's first start times
Qwen3-0.6B's shapes and keeps its choices; a later start takes what the file says instead of timing (the file
is rewritten to force each way, and `runtime.gemv_layers` follows it); a garbled file is timed again and
rewritten. Skipped without CUDA."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.fixtures.tiny_models import widened_to_qwen3_06b

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _start(path: Path) -> tuple[int, int]:
    """Start an engine, decode a few tokens: (layers taking the GEMV, layers folding the op before it)."""
    llm = LLM(str(path), device="cuda", dtype="bfloat16", load_format="dummy", num_kv_blocks=64)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 4
        return llm.runtime.gemv_layers, llm.runtime.prologue_layers
    finally:
        llm.shutdown()


def _rewrite(file: Path, gemv: bool) -> None:
    """Every kept choice set to cuBLAS from the plain layout, or (for the shapes timed against it) the GEMV."""
    data = json.loads(file.read_text())
    for entry in data["choices"]:
        data["choices"][entry] = {"transposed": False, "gemv": gemv and ":gemv:" in entry, "prologue": False}
    file.write_text(json.dumps(data))


def test_a_later_start_takes_the_kept_choices(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("ASYNCLLM_TUNING_CACHE", "1")  # off for every other test (tests/conftest.py)
    path = widened_to_qwen3_06b(tiny_model, tmp_path / "wide")
    _start(path)
    files = list((tmp_path / "cache" / "asyncllm" / "tuning").glob("gemm-*.json"))
    assert len(files) == 1
    kept = json.loads(files[0].read_text())["choices"]
    assert any(":gemv:" in entry for entry in kept)  # 0.6B's shapes are timed against the GEMV
    _rewrite(files[0], gemv=False)
    assert _start(path) == (0, 0)
    _rewrite(files[0], gemv=True)
    gemv_layers, _ = _start(path)
    assert gemv_layers == 2 * sum(":gemv:" in entry for entry in kept)  # each shape: both layers
    files[0].write_text("{garbled")
    with caplog.at_level(logging.WARNING, logger="asyncllm.worker.tuning_cache"):
        _start(path)
    assert "timing again" in caplog.text
    assert json.loads(files[0].read_text())["choices"].keys() == kept.keys()
