"""bench/kernels/bench_fused_moe.py on CPU: it skips cleanly without CUDA, and its case (routing, the on-device
check against the reference, byte and FLOP counts, the JSON fields) works on a tiny float32 shape through the
interpreter, so the GPU run does not find its bugs first. Timing needs CUDA and is stubbed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.triton_kernels import HAS_CUDA, import_kernel

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    import_kernel("fused_moe")  # in the interpreter without CUDA, before the bench imports it
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports bench_fused, beside it
    spec = importlib.util.spec_from_file_location("bench_fused_moe", BENCH / "bench_fused_moe.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_fused_moe", module)
    spec.loader.exec_module(module)
    for name, value in dict(DEVICE="cpu", DTYPE=torch.float32, HIDDEN=64, EXPERTS=8, TOP_K=2).items():
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(module, "time_us", lambda fn, **kwargs: (fn(), (2.0, 9.0))[1])
    return module


@pytest.mark.skipif(HAS_CUDA, reason="the skip path is for machines without CUDA")
def test_skips_cleanly_without_cuda(bench, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["bench_fused_moe.py"])
    bench.main()
    assert "skipped" in json.loads(capsys.readouterr().out)


@pytest.mark.skipif(HAS_CUDA, reason="CPU shapes; on GPU run the bench itself")
def test_case_checks_and_reports(bench) -> None:
    line = bench.run(5, 32, torch.Generator().manual_seed(0))
    assert line["check"] == "ok" and line["tokens"] == 5 and line["block_m"] == 16
    assert 1 <= line["experts_touched"] <= 8
    assert line["limit_us"] > 0 and line["bound"] in ("bytes", "flops")
    json.dumps(line)
