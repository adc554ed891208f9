"""Tensor parallelism (two CPU ranks, gloo) with constrained requests, steps overlapped: every rank runs the
same matchers from the same tokens (the worker process compiles with its own backend), so the tokens it feeds
itself on the device (PLACEHOLDER) are rank 0's, and the result equals one process's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncllm import LLM
from tests.structured.conftest import ENGINE_ARGS, check, constrained, overlapped_engine

pytestmark = pytest.mark.slow  # starts processes or servers: seconds each


async def test_tp2_overlapped_constrained_equals_one_process(tiny_model: Path, llm_drawing: LLM) -> None:
    """Tensor parallelism never jumps forward: its twin is one process without it."""
    cases = [("person", "greedy", 0), ("grammar", "greedy", 0), ("regex", "greedy", 0), ("choice", "t1", 4)]
    params = [constrained(*case) for case in cases]
    prompts = ["Hello", [5, 6, 7], "日本語", [9, 10]]
    want = llm_drawing.generate(prompts, params, use_tqdm=False)
    engine = overlapped_engine(tiny_model, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        got = await asyncio.wait_for(asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params))), 120)
    finally:
        engine.shutdown()
    for (name, _, _), out, ref in zip(cases, got, want):
        assert (out.token_ids, out.finish_reason) == (ref.token_ids, ref.finish_reason), name
        check(name, out.text)
