"""bench/kernels/bench_varlen_attention.py on CPU: its cases (inputs, the check against the twin, the padded
SDPA baseline, the JSON line) run on tiny float32 shapes through the interpreter, so the GPU run does not
find their bugs first. Timing itself needs CUDA and is stubbed; PyTorch's flash varlen kernel is CUDA-only
and reported unavailable."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.triton_kernels import import_kernel

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "bench_varlen_attention.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    import_kernel("varlen_attention")  # in the interpreter without CUDA, before the bench imports it
    spec = importlib.util.spec_from_file_location("bench_varlen_attention", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_varlen_attention", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "DTYPE", torch.float32)  # the interpreter's 16-bit loads are wrong
    monkeypatch.setattr(module, "SHAPES", {"bert-base": (2, 2, 16), "qwen3-0.6b": (4, 2, 32)})
    monkeypatch.setattr(module, "time_ms", lambda fn, repeats=20: (fn(), 2.0)[1])
    return module


def test_cases_run_on_tiny_shapes(bench, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["bench_varlen_attention.py", "--seqs", "3", "--min-len", "1", "--max-len", "40"])
    bench.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [("causal" in r["shape"], r["shape"].split()[0]) for r in lines] == [
        (False, "bert-base"),
        (False, "qwen3-0.6b"),
        (True, "qwen3-0.6b"),
    ]
    for result in lines:
        assert result["max_err"] <= 1e-5 and result["speed_vs_padded_sdpa"] == 1.0
        assert result["flash_varlen"].startswith("unavailable")
