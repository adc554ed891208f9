"""An engine's build says what it does: the model it loads, weight-loading progress when that takes long, and
a banner of what it built (device, dtype, KV cache, limits, seconds per phase), on the `asyncllm` logger;
`runtime.startup_seconds` covers the whole build (regression: it timed 5 of 15-17 s, the weights only)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncllm.build import build_engine
from asyncllm.config import EngineConfig
from asyncllm.model_loader.progress import with_progress


def test_startup_seconds_cover_the_build_and_the_banner_says_what_was_built(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = EngineConfig.from_kwargs(str(tiny_model), device="cpu", block_size=4, num_kv_blocks=64)
    caplog.set_level(logging.INFO, logger="asyncllm")
    start = time.perf_counter()
    built = build_engine(config, time.monotonic)
    wall = time.perf_counter() - start
    built.core.shutdown()
    phases = dict(built.runtime.startup_seconds)
    assert list(phases)[:2] == ["import", "open"] and {"load", "kv_cache"} <= set(phases)
    assert list(phases)[-1] == "other" and all(s >= 0 for s in phases.values())
    # All but logging the banner and returning (milliseconds); the weights alone were half of it here.
    assert 0.8 * wall <= sum(phases.values()) <= wall, (phases, wall)
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncllm"]
    assert lines[0] == f"loading {tiny_model} (device cpu)"
    banner = "\n".join(lines[1:])
    assert f"engine ready in {sum(phases.values()):.1f} s: {tiny_model} (Qwen3ForCausalLM)" in banner, banner
    assert "cpu, float32, torch attention, no CUDA graphs (eager)" in banner, banner
    mib = built.runtime.kv_cache_bytes / 2**20
    assert mib == 64 * 4 * 2 * 2 * 16 * 2 * 4 / 2**20  # blocks, tokens, K and V, layers, KV heads, head_dim, fp32
    assert f"KV cache 256 tokens (64 blocks of 4, {mib:.1f} MiB); max_model_len 512, max_num_seqs 256" in banner
    assert "start-up: import " in banner and ", other " in banner


def _slow(n: int, seconds: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(seconds)
        yield i


def test_weight_loading_logs_progress_only_when_it_takes_long(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asyncllm.model_loader")
    assert list(with_progress(_slow(4, 0.0), total=4, every_s=60.0)) == [0, 1, 2, 3]
    assert not caplog.records  # a fast load says nothing
    assert list(with_progress(_slow(4, 0.01), total=4, every_s=0.005)) == [0, 1, 2, 3]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("loading weights: 1 tensors of 4 (25 %) after") and len(messages) == 4
    caplog.clear()
    list(with_progress(_slow(2, 0.01), total=None, every_s=0.005))
    assert caplog.records[-1].getMessage().startswith("loading weights: 2 tensors after")


def test_a_tokenizer_that_cannot_load_fails_the_build_naming_it(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer loads beside the worker's set-up (`open_checkpoint(background_tokenizer=True)`): one that
    cannot load still fails the build, naming its directory, and the worker built meanwhile is shut down."""
    from asyncllm.errors import UnsupportedModelError
    from asyncllm.executor.uniproc import UniProcExecutor
    from tests.fixtures.tiny_models import linked_checkpoint

    broken = linked_checkpoint(tiny_model, tmp_path / "broken", tokenizer__json="{ not json")
    shut: list[UniProcExecutor] = []
    shutdown = UniProcExecutor.shutdown
    monkeypatch.setattr(UniProcExecutor, "shutdown", lambda self: (shut.append(self), shutdown(self))[1])
    config = EngineConfig.from_kwargs(str(broken), device="cpu", block_size=4, num_kv_blocks=64)
    with pytest.raises(UnsupportedModelError, match=f"the tokenizer in {broken} could not be loaded"):
        build_engine(config, time.monotonic)
    assert len(shut) == 1, "the executor built beside the tokenizer must be shut down"
