"""bench/kernels/bench_fused.py on CPU: it skips cleanly without CUDA, and its cases (inputs, the on-device
correctness check, byte counts, the JSON line, a failing torch.compile) work on tiny float32 shapes through
the interpreter, so the GPU run does not find its bugs first. Timing itself needs CUDA and is stubbed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.triton_kernels import HAS_CUDA, import_kernel

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "bench_fused.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    for name in ("rms_norm", "silu_mul", "qk_norm_rope_kv"):
        import_kernel(name)  # in the interpreter without CUDA, before the bench imports them
    spec = importlib.util.spec_from_file_location("bench_fused", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_fused", module)  # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "DTYPE", torch.float32)  # the interpreter's 16-bit loads are wrong
    monkeypatch.setattr(module, "MODELS", {"tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128)})
    monkeypatch.setattr(module, "MAX_POSITIONS", 64)
    monkeypatch.setattr(module, "time_us", lambda fn: (fn(), (2.0, 9.0))[1])
    monkeypatch.setattr(module, "l2_bytes", lambda: 50 << 20)
    return module


@pytest.mark.skipif(HAS_CUDA, reason="the skip path is for machines without CUDA")
def test_skips_cleanly_without_cuda(bench, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["bench_fused.py"])
    bench.main()
    assert "skipped" in json.loads(capsys.readouterr().out)


@pytest.mark.skipif(HAS_CUDA, reason="CPU shapes; on GPU run the bench itself")
def test_cases_check_and_report(bench, capsys: pytest.CaptureFixture) -> None:
    """Every kernel's case at two token counts: checks pass, bytes are counted, one JSON line each; a compiled
    reference that fails is reported in its line, not raised."""

    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")

    for name in bench.KERNELS:
        for tokens in (1, 5):
            compiled = {name: broken} if tokens == 5 else {}
            assert bench.bench(name, "tiny", tokens, compiled, use_compile=tokens == 5)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 * len(bench.KERNELS)
    for line in lines:
        assert line["check"] == "ok" and line["bytes"] > 0 and line["triton_us"] == 2.0, line
        assert line["winner"] in ("eager", "triton")
        assert ("compile_error" in line) == (line["tokens"] == 5), line
    rms = next(line for line in lines if line["kernel"] == "rms_norm+residual" and line["tokens"] == 5)
    assert rms["bytes"] == (4 * 5 * 64 + 64) * 4
