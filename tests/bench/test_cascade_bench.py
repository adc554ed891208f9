"""bench/kernels/bench_cascade.py and bench/w3_cascade.py on CPU, so the device run does not find their bugs
first: the kernel bench's host part plans the cascade for shared prefixes and the plain plan for unshared ones
(the kernels in Triton's interpreter); W3's prompts are the peer script's (its seed), and a toy W3 runs both
engines to the same token count."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench.scripts import bench_script
from tests.fixtures.triton_kernels import HAS_CUDA

KERNEL_BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels"


@pytest.fixture(scope="module")
def kernel_bench() -> Iterator[ModuleType]:
    pytest.importorskip("triton")
    sys.path.insert(0, str(KERNEL_BENCH))
    try:
        yield importlib.import_module("bench_cascade")
    finally:
        sys.path.remove(str(KERNEL_BENCH))
        sys.modules.pop("bench_cascade", None)


@pytest.mark.skipif(HAS_CUDA, reason="CPU smoke test (the interpreter runs only without CUDA)")
def test_host_plans_cascade_only_where_prefixes_are_shared(kernel_bench: ModuleType, capsys) -> None:
    import torch

    kernel_bench.bench_host(argparse.Namespace(groups=2, prefix=256), torch.device("cpu"))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prefixes_shared"], r["cascade"]) for r in lines] == [(True, True), (False, False)]


@pytest.mark.skipif(HAS_CUDA, reason="CPU smoke test (the interpreter runs only without CUDA)")
@pytest.mark.slow
def test_device_part_runs_in_the_interpreter(kernel_bench: ModuleType, capsys, monkeypatch) -> None:
    """The GPU half's plans, binds and launches, float32 in the interpreter at a toy size (timed once on the
    host): every cascade run equals the plain one."""
    import time

    import torch

    for name, value in (("MAX_LEN", 512), ("HEADS", 4), ("KV_HEADS", 2), ("HEAD_DIM", 16), ("UNIQUE", (1, 40))):
        monkeypatch.setattr(kernel_bench, name, value)

    def once(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    args = argparse.Namespace(groups=1, prefix=128, prefix_splits=[0, 2])
    kernel_bench.bench_device(args, torch.device("cpu"), timer=once, dtype=torch.float32)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("kernel") for r in lines[:-1]] == ["plain", "cascade/1", "cascade/2"]
    assert lines[-1]["max_abs_diff"] < 1e-4


def test_w3_prompts_are_the_peer_scripts() -> None:
    with bench_script("w3_cascade") as w3:
        prompts = w3.w3_prompts(groups=3, prefix=20, unique=4)
    assert len(prompts) == 48 and all(len(p) == 24 for p in prompts)
    assert prompts[0][:20] == prompts[15][:20] != prompts[16][:20]  # 16 a group, each its own prefix
    assert prompts[0][20:] != prompts[1][20:]


@pytest.mark.slow
def test_w3_measure_runs_on_cpu() -> None:
    with bench_script("w3_cascade", needs_tokenizer=True) as w3:
        argv = ["--shape", "qwen3-tiny", "--device", "cpu", "--groups", "1", "--prefix", "16", "--unique", "4"]
        args = w3.parser().parse_args([*argv, "--max-tokens", "2", "--max-model-len", "256"])
        auto, off = (w3.measure(args, kind) for kind in ("cascade_auto", "cascade_off"))
    assert auto["output_tokens"] == off["output_tokens"] == 16 * 2
