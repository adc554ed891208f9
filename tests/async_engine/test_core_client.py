"""`AsyncLLMEngine` reaches its core only through `EngineCoreClient`: around a client that lets it use
nothing else, an engine streams, aborts, reports stats and health, and ends every stream when stopped."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import pytest

from asyncllm import AsyncLLMEngine, EngineDeadError, SamplingParams
from asyncllm.async_engine.core_client import EngineCoreClient
from asyncllm.async_engine.inproc_client import InProcClient
from asyncllm.async_engine.router import OutputRouter
from tests.async_engine.conftest import wait_drained
from tests.fixtures.fake_core import FakeBuilt, fake_built, offline_run

PROTOCOL = {name for name in vars(EngineCoreClient) if not name.startswith("_")}


class OnlyTheProtocol:
    """A client that hands out the protocol's members of the client inside, and fails on anything else."""

    def __init__(self, inner: InProcClient) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name not in PROTOCOL:
            raise AttributeError(f"the engine used {name!r}, which EngineCoreClient does not name")
        return getattr(self._inner, name)


async def test_an_engine_needs_nothing_of_its_core_beyond_the_protocol(bpe_tokenizer: Any) -> None:
    built = fake_built(bpe_tokenizer, step_delay=0.002, max_model_len=4096)
    made: list[OnlyTheProtocol] = []

    def make_client(router: OutputRouter) -> EngineCoreClient:
        made.append(OnlyTheProtocol(InProcClient(lambda: built, router)))
        return made[-1]  # type: ignore[return-value]

    engine = AsyncLLMEngine.from_client(make_client)
    try:
        assert len(made) == 1 and engine.runtime is built.runtime and engine.tokenizer is bpe_tokenizer
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        (want,) = offline_run(fake_built(bpe_tokenizer), ["Hello world"], [params])
        out = await engine.generate("Hello world", params)
        assert (out.token_ids, out.text) == want
        endless = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4000, ignore_eos=True))
        first = await endless.__anext__()
        assert first.finish_reason is None
        await engine.abort(endless.request_id)
        assert [c async for c in endless][-1].finish_reason == "abort"
        stats = await wait_drained(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        await engine.check_health()
        assert engine.is_running and engine.step_seconds >= 0.0
        pending = engine.add_request([8, 9], SamplingParams(max_tokens=4000, ignore_eos=True))
        await asyncio.wait_for(engine.aclose(), 5)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in pending:
                pass
        assert not engine.is_running and built.executor.is_shut_down
    finally:
        engine.shutdown()


def test_ctrl_c_during_the_load_leaves_the_constructor_at_once_and_the_core_is_released(bpe_tokenizer: Any) -> None:
    """Ctrl-C while the step thread builds the core raises KeyboardInterrupt from the constructor at once,
    even when the kernel delivered the signal to another thread (whose handler wakes no wait in this one),
    and the step thread releases the core once its build returns, rather than holding it (and the device)
    with no engine left to reach it."""
    built = fake_built(bpe_tokenizer)
    building, finish = threading.Event(), threading.Event()

    def build() -> FakeBuilt:
        building.set()
        finish.wait(10)  # a load that takes its time
        return built

    def ctrl_c_in_this_thread() -> None:
        building.wait(10)
        time.sleep(0.3)  # the constructor waits for the load by now
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    interrupter = threading.Thread(target=ctrl_c_in_this_thread)
    interrupter.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            AsyncLLMEngine.from_builder(build)
        assert time.monotonic() - start < 5  # not at the end of the load
    finally:
        finish.set()
        interrupter.join()
    deadline = time.monotonic() + 10
    while not built.executor.is_shut_down:
        assert time.monotonic() < deadline, "the step thread kept the core it built"
        time.sleep(0.01)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["serial", "overlapped"])
async def test_an_idle_engine_captures_the_pending_graphs_one_at_a_time(bpe_tokenizer: Any, asynchronous: bool) -> None:
    """Lazy capture's graphs are captured while nothing is in flight (the fake executor raises on a capture
    beside a queued step), one at a time: a request sent meanwhile waits for one capture at most, not for all
    of them, and gets the tokens it would alone; `stats()["cuda_graphs_pending"]` falls to 0."""
    pending, capture_s = 20, 0.1
    built = fake_built(bpe_tokenizer, asynchronous=asynchronous, cuda_graphs_pending=pending, capture_delay=capture_s)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts: list[str | list[int]] = [[5 + i, 6, 7] for i in range(3)]
    want = offline_run(fake_built(bpe_tokenizer), prompts, [params] * len(prompts))
    engine = AsyncLLMEngine.from_builder(lambda: built)
    try:
        got, took = [], []
        for prompt in prompts:
            await asyncio.sleep(capture_s / 2)  # the engine idles: captures run
            start = time.monotonic()
            out = await engine.generate(prompt, params)
            took.append(time.monotonic() - start)
            got.append((out.token_ids, out.text))
        assert got == want
        assert max(took) < pending * capture_s / 4, took  # all the captures would take 2 s
        deadline = time.monotonic() + 10
        while engine.stats()["cuda_graphs_pending"]:
            assert time.monotonic() < deadline, engine.stats()
            await asyncio.sleep(0.05)
        assert built.executor.captures == pending and engine.is_running
    finally:
        await engine.aclose()
