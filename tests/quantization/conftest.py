"""Quantized tiny checkpoints, built once per session on first use: (quantized dir, dequantized float twin,
intended float32 weights) per (format, options)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.quantized import build_quantized

# name -> (format, options): the variants the tests load
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "awq": ("awq", {}),
    "awq-g32": ("awq", {"group_size": 32}),
    "gptq": ("gptq", {}),
    "gptq-asym-g32": ("gptq", {"sym": False, "group_size": 32}),
    "gptq-int8": ("gptq", {"bits": 8, "group_size": 32, "sym": False}),
    "gptq-v2": ("gptq", {"checkpoint_format": "gptq_v2", "sym": False}),
    "gptq-per-channel": ("gptq", {"group_size": -1}),
    "fp8-channel": ("fp8-channel", {}),
    "fp8-tensor": ("fp8-tensor", {}),
    "fbgemm": ("fbgemm", {}),
    "fp8-block": ("fp8-block", {}),
}


@pytest.fixture(scope="session")
def quantized_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict]]:
    root = tmp_path_factory.mktemp("quantized")

    class _Lazy(dict):
        def __missing__(self, name: str) -> tuple[Path, Path, dict]:
            fmt, options = VARIANTS[name]
            built = build_quantized(root / name, fmt, **options)
            self[name] = built
            return built

    return _Lazy()
