"""Layer rule: the public surface and the async layer never import torch at module import (a fresh
interpreter proves it, since this test process may already hold torch)."""

from __future__ import annotations

import subprocess
import sys

_CHECK = """
import sys
import asyncllm, asyncllm.async_engine.engine
from asyncllm import AsyncLLMEngine, SamplingParams, StreamOutput, RequestOutput
import asyncllm.async_engine.stream, asyncllm.async_engine.step_loop, asyncllm.async_engine.loop_fanout
import asyncllm.async_engine.ids
heavy = sorted(m for m in ("torch", "transformers", "triton", "numpy") if m in sys.modules)
print(",".join(heavy) or "clean")
"""


def test_async_layer_import_leaves_torch_out() -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "clean", f"imported at module import: {out.stdout.strip()}"
