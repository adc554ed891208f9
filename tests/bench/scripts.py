"""The bench scripts imported as they run: from bench/, where they import their neighbours as top-level modules
(`shapes`, `w1_throughput`, ...). Each test file imports them through `bench_script`; every module loaded from
bench/ meanwhile is dropped afterwards, so the next file starts from fresh copies and nothing lists them by hand."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextmanager
def bench_script(name: str, *, needs_tokenizer: bool = False) -> Iterator[ModuleType]:
    """bench/`name`.py as a module; with `needs_tokenizer`, the test is skipped where the real Qwen3 tokenizer
    the script's workload uses cannot be found."""
    sys.path.insert(0, str(BENCH))
    try:
        if needs_tokenizer:
            try:
                importlib.import_module("shapes").find_qwen3_tokenizer()
            except FileNotFoundError as e:
                pytest.skip(str(e))
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
        for key, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if file is not None and Path(file).parent == BENCH:
                del sys.modules[key]
