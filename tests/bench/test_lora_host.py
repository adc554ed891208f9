"""bench/lora_host.py on CPU with a few calls, so the device run does not find its bugs first: every figure
comes out, the LoRA staging of a repeated batch costs less than that of a changed one, and the kernels it
stands in for on CPU (nothing to launch on) launch for real again afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from asyncllm.kernels.lora_ref import lora_ref
from tests.bench.scripts import bench_script
from tests.fixtures.triton_kernels import import_kernel


@pytest.fixture(scope="module")
def lora_host() -> Iterator[ModuleType]:
    with bench_script("lora_host") as module:
        yield module


def test_figures_on_cpu(lora_host: ModuleType) -> None:
    if torch.cuda.is_available():
        pytest.skip("on CUDA the launches run for real: the GPU machine runs the script itself")
    kernels = import_kernel("lora")  # Triton's interpreter
    same, changed, prompt = lora_host.staging(torch.device("cpu"), calls=10)
    assert [r["step"] for r in (same, changed, prompt)] == [
        "decode, same batch",
        "decode, batch changed",
        "prompt step, 8 x 1024 + 248 decodes",
    ]
    assert 0 < float(same["lora_stage_us"]) < float(changed["lora_stage_us"])
    rows = lora_host.launches(torch.device("cpu"), 512, calls=5)
    assert [r["site"] for r in rows] == ["qkv", "o", "gate_up", "down", "4 sites x 28 layers"]
    # the stand-in kernels do not outlive the measurement: lora_add adds the adapter again
    a, b = torch.randn(1, 16, 32), torch.randn(1, 16, 16)
    x, y = torch.randn(3, 32), torch.randn(3, 16)
    tokens, blocks = (torch.as_tensor(t) for t in lora_host.plan_lora_blocks([0], [3], 1, 3))
    expected = lora_ref(x, y.clone(), a, b, torch.zeros(3, dtype=torch.int32), [16])
    torch.testing.assert_close(kernels.lora_add(x, y.clone(), a, b, tokens, blocks, [16]), expected)
