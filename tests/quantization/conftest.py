"""The quantization tests hold the reference path to exact results: on a CPU with the int4 kernel they would
otherwise take it (bfloat16 inputs), so they pin ASYNCLLM_CPU_INT4=off; test_cpu_int4.py turns it back on."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_CPU_INT4", "off")
