"""Fixtures for async-engine tests: engines around a fake core, and every async test run on both the
default asyncio loop and uvloop."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvloop

from asyncllm import AsyncLLMEngine
from asyncllm.async_engine.proc_client import ProcClient
from asyncllm.core.detokenizer import backend_tokenizer
from tests.fixtures.fake_core import FakeBuilt, fake_built
from tests.fixtures.tiny_models import build_tokenizer


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny checkpoints' byte-level BPE tokenizer (CJK and emoji merges), as a Rust Tokenizer."""
    return backend_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


EngineFactory = Callable[..., tuple[AsyncLLMEngine, FakeBuilt]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "make_engine" in metafunc.fixturenames:
        modes = ["serial", "overlap"]
        if metafunc.definition.get_closest_marker("core_process") is not None:
            modes.append("process")
        metafunc.parametrize("make_engine", modes, indirect=True)


@pytest.fixture
def make_engine(request: pytest.FixtureRequest, bpe_tokenizer: Any) -> Iterator[EngineFactory]:
    """`make_engine(**fake_built_kwargs) -> (engine, built)`; every engine is shut down after the test.

    Every test using it runs twice: with a synchronous fake executor, and with an asynchronous one (steps
    run when their result is asked for), so the core overlaps planning with the step in flight, as on a GPU.
    A test marked `core_process` runs a third time (on asyncio only: the loop library is the front's
    business) with the asynchronous core in a process of its own (`ProcClient`; its fake_built arguments
    must pickle). There `built` is a twin made in this process from the same arguments (its runtime,
    tokenizer and input checks are the core's); reaching for its executor skips the test from there on,
    the executor being in the other process.
    """
    engines: list[AsyncLLMEngine] = []
    mode = request.param
    if mode == "process" and "uvloop" in request.node.name:
        pytest.skip("the core process is tested on asyncio; uvloop adds nothing to its pipes")

    def make(*, text: bool = True, **kwargs: Any) -> tuple[AsyncLLMEngine, FakeBuilt]:
        kwargs.setdefault("asynchronous", mode != "serial")
        tokenizer = bpe_tokenizer if text else None
        built = fake_built(tokenizer, **kwargs)
        if mode == "process":
            build = functools.partial(fake_built, tokenizer, **kwargs)
            engine = AsyncLLMEngine.from_client(functools.partial(ProcClient, build))
            built = dataclasses.replace(built, executor=_ElsewhereExecutor())  # type: ignore[arg-type]
        else:
            engine = AsyncLLMEngine.from_builder(lambda: built)
        engines.append(engine)
        return engine, built

    yield make
    for engine in engines:
        engine.shutdown()
        assert not engine.is_running


class _ElsewhereExecutor:
    def __getattr__(self, name: str) -> Any:
        pytest.skip(f"reads the fake executor's {name!r}, which runs in the core process")


async def wait_drained(engine: AsyncLLMEngine, timeout: float = 5.0) -> dict[str, float | int]:
    """Wait until no request is live and every block is free (as the published stats say); return them."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        drained = (
            engine.num_live_requests == 0
            and stats["num_running"] == 0
            and stats["num_waiting"] == 0
            and stats["num_free_blocks"] == stats["num_total_blocks"]
        )
        if drained:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not drained after {timeout} s: {stats}, live={engine.num_live_requests}")
        await asyncio.sleep(0.005)
