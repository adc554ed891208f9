"""torch's CPU threads: the `num_threads` engine argument is applied in the thread that builds and steps the
model (torch keeps the count per thread), and its default leaves one core to the engine's other threads."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncllm import LLM
from asyncllm.worker.threads import available_cores, default_num_threads


def test_default_leaves_a_core_and_is_shared_among_ranks() -> None:
    cores = available_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    cpu = torch.device("cpu")
    assert default_num_threads(cpu) == max(1, cores - 1)
    assert default_num_threads(cpu, world_size=2) == max(1, (cores - 1) // 2)
    assert default_num_threads(torch.device("cuda", 0)) is None  # torch's own default on CUDA


def _build_in_thread(**engine_args: Any) -> tuple[LLM, int]:
    """An LLM built in a fresh thread, and torch's thread count in that thread afterwards."""
    out: dict[str, Any] = {}

    def build() -> None:
        out["llm"] = LLM(str(engine_args.pop("model")), device="cpu", num_kv_blocks=16, **engine_args)
        out["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    return out["llm"], out["threads"]


@pytest.fixture
def restore_threads() -> Any:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)  # torch's count for threads started later (and this one)


@pytest.mark.usefixtures("restore_threads")
def test_num_threads_is_applied_where_the_model_runs(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asyncllm")
    llm, in_thread = _build_in_thread(model=tiny_model, num_threads=3)
    try:
        assert in_thread == 3 and llm.runtime.num_threads == 3
        assert "3 CPU threads" in caplog.text  # the banner says what the engine runs with
        assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("restore_threads")
def test_default_threads_are_applied(tiny_model: Path) -> None:
    llm, in_thread = _build_in_thread(model=tiny_model)
    try:
        assert in_thread == llm.runtime.num_threads == default_num_threads(torch.device("cpu"))
    finally:
        llm.shutdown()
