"""Shared fixtures: one engine on the tiny Qwen3 checkpoint (CPU) behind two real uvicorn servers, one open
and one with an API key, started once per session; tests talk to them over HTTP with the openai client.

With ASYNCLLM_TEST_REPLICAS=N in the environment the engine is a `ReplicaPool` of N replicas on Ray (on the
cluster at $RAY_ADDRESS, else a local one), and only the tests that use it run: tests/ray/test_server_replicas.py
runs this folder so."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.fixtures.chat_templates import HERMES
from tests.fixtures.tiny_models import build_checkpoint
from tests.server.serving import RunningServer, start_server
from tests.server.test_tools import ENGINE_ARGS as TOOLS_ENGINE_ARGS

MODEL = "tiny"
API_KEY = "test-secret-key"
ENGINE_ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=1024, max_model_len=512)


REPLICAS = int(os.environ.get("ASYNCLLM_TEST_REPLICAS", "0"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Against a pool, only the tests that reach the shared engine (directly or through a server) run: the
    others build engines of their own, which a pool would not change. A module with an `engine` fixture of its
    own (test_core_process.py: the same tests over a core process) is one of those others."""
    if REPLICAS:
        chosen = [
            item
            for item in items
            if "engine" in getattr(item, "fixturenames", ()) and not hasattr(getattr(item, "module", None), "engine")
        ]
        config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
        items[:] = chosen


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Iterator[AsyncLLMEngine]:
    if REPLICAS:
        from asyncllm.ray import ReplicaPool

        engine: AsyncLLMEngine = ReplicaPool(
            str(tiny_model), num_replicas=REPLICAS, ray_actor_options={"num_cpus": 0}, **ENGINE_ARGS
        )
    else:
        engine = AsyncLLMEngine(str(tiny_model), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(engine, served_model_name=MODEL))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def keyed_server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    """The same engine behind a second app that needs an API key (plain asyncio loop this time)."""
    running = start_server(create_app(engine, served_model_name=MODEL, api_key=API_KEY), loop="asyncio")
    yield running
    running.stop()


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
async def aclient(server: RunningServer) -> Any:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def metric_value(server: RunningServer, name: str, **labels: str) -> float:
    """One sample of GET /metrics, parsed with prometheus_client's own parser (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def wait_drained(engine: AsyncLLMEngine, timeout: float) -> dict[str, float | int]:
    """Wait until nothing runs or waits and every block is free; return those stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (
            stats["num_running"] == 0
            and stats["num_waiting"] == 0
            and stats["num_free_blocks"] == stats["num_total_blocks"]
        ):
            return stats
        assert time.monotonic() < deadline, f"engine not drained after {timeout} s: {stats}"
        time.sleep(0.005)


# The API tests' engine with room for tool calls (one per module that asks: module scope), behind a server
# templating with the Hermes tool format.
@pytest.fixture(scope="module")
def tools_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    path = build_checkpoint(tmp_path_factory.mktemp("tools") / "qwen3", "qwen3", max_position_embeddings=2048)
    engine = AsyncLLMEngine(str(path), **TOOLS_ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tools_server(tools_engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(tools_engine, served_model_name="tiny-tools", chat_template=HERMES))
    yield running
    running.stop()
