"""Output-constraint compiles never hold other requests (issue 39, finding 2): a request that needs no compile
passes one still compiling, compiles run beside each other, and one past `grammar_compile_timeout` fails its
request alone (`GrammarCompileTimeoutError`) and gives its thread back. On the fake core, with a compiler
held at a gate (in-process) or sleeping (in the core's process), and through `Compiles` itself."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from asyncllm import AsyncLLMEngine, GrammarCompileTimeoutError, InvalidRequestError, SamplingParams
from asyncllm.async_engine.compiles import COMPILE_WORKERS, Compiles
from asyncllm.async_engine.proc_client import ProcClient
from asyncllm.outputs import RequestOutput
from asyncllm.structured import StructuredOutput
from tests.async_engine.conftest import wait_drained
from tests.fixtures.fake_core import FakeBuilt, fake_built

QUICK = SamplingParams(max_tokens=4)


class HeldCompiler:
    """`check_constraint` for the fake core: a regex starting "hold" waits for `release`; others pass at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.running = 0
        self.most_running = 0

    def __call__(self, spec: StructuredOutput) -> None:
        with self.lock:
            self.started.append(spec.text)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if spec.text.startswith("hold"):
                assert self.release.wait(20), "the test never released the compiler"
        finally:
            with self.lock:
                self.running -= 1

    def wait_started(self, n: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.started) < n:
            assert time.monotonic() < deadline, f"{len(self.started)} compiles started, not {n}"
            time.sleep(0.002)


def held(name: str) -> SamplingParams:
    return SamplingParams(max_tokens=4, regex=f"hold{name}")


@pytest.fixture
def compiler() -> Iterator[HeldCompiler]:
    held_compiler = HeldCompiler()
    yield held_compiler
    held_compiler.release.set()


def engine_with(bpe_tokenizer: Any, compiler: HeldCompiler, timeout: float = 30.0) -> AsyncLLMEngine:
    built = dataclasses.replace(fake_built(bpe_tokenizer), check_constraint=compiler)
    return AsyncLLMEngine.from_builder(lambda: built, grammar_compile_timeout=timeout)


async def timed(awaitable: Any) -> tuple[RequestOutput, float]:
    start = time.perf_counter()
    out = await awaitable
    return out, time.perf_counter() - start


async def test_requests_needing_no_compile_pass_one_still_compiling(bpe_tokenizer: Any, compiler: HeldCompiler) -> None:
    """Regression (issue 39, finding 2): compiles ran on the tokenizer thread in arrival order, so a 4-token
    request added behind a 5-21 s compile waited for it."""
    engine = engine_with(bpe_tokenizer, compiler)
    try:
        _, usual = await timed(engine.generate([5, 6, 7], QUICK))
        slow = [engine.add_request([1, 2, 3], held("ids")), engine.add_request("a text prompt", held("text"))]
        await asyncio.to_thread(compiler.wait_started, 2)
        for prompt in ([5, 6, 7], "another text"):  # token ids and text alike
            out, took = await timed(engine.generate(prompt, QUICK))
            assert out.finish_reason == "length" and took < usual + 1.0
        assert compiler.running == 2  # both compiles still held
        compiler.release.set()
        for stream in slow:
            assert [c async for c in stream][-1].finish_reason == "length"
        await wait_drained(engine)
    finally:
        engine.shutdown()


async def test_compiles_run_beside_each_other_up_to_the_workers(bpe_tokenizer: Any, compiler: HeldCompiler) -> None:
    engine = engine_with(bpe_tokenizer, compiler)
    try:
        streams = [engine.add_request([1, 2, i], held(str(i))) for i in range(COMPILE_WORKERS)]
        await asyncio.to_thread(compiler.wait_started, COMPILE_WORKERS)  # all at once, none finished
        quick = asyncio.ensure_future(engine.generate([9, 9], SamplingParams(max_tokens=2, regex="quick")))
        await asyncio.sleep(0.2)
        assert not quick.done() and compiler.most_running == COMPILE_WORKERS  # the next waits for a thread
        compiler.release.set()
        assert (await quick).finish_reason == "length"
        for stream in streams:
            assert [c async for c in stream][-1].finish_reason == "length"
        await wait_drained(engine)
    finally:
        engine.shutdown()


async def test_a_compile_past_the_timeout_fails_its_request_alone(bpe_tokenizer: Any, compiler: HeldCompiler) -> None:
    engine = engine_with(bpe_tokenizer, compiler, timeout=0.3)
    try:
        start = time.perf_counter()
        stuck = engine.add_request([1, 2, 3], held("stuck"))
        with pytest.raises(GrammarCompileTimeoutError, match=r"regex did not compile within grammar_compile_timeout"):
            [c async for c in stuck]
        assert 0.3 <= time.perf_counter() - start < 3.0
        assert isinstance(GrammarCompileTimeoutError("x"), InvalidRequestError)  # a 400 from the server
        # Its compile still runs, abandoned: the next ones get threads of their own.
        out = await engine.generate([4, 5], SamplingParams(max_tokens=2, regex="next"))
        assert out.finish_reason == "length" and compiler.running == 1
        compiler.release.set()  # the abandoned compile ends: nothing more reaches its stream or the core
        await wait_drained(engine)
        assert engine.stats()["num_queued"] == 0
    finally:
        engine.shutdown()


async def test_waiting_compiles_time_out_unstarted_and_abandoned_ones_are_bounded(
    bpe_tokenizer: Any, compiler: HeldCompiler
) -> None:
    """At most COMPILE_WORKERS abandoned compiles run on: past that new compiles wait for one of them to end (so
    crafted constraints cannot take every core), and one that never got a thread is dropped unrun."""
    # 0.5 s: `waiting` below must get its thread within its own timeout of its submission, after the sleep and
    # the release; with 0.3 s a loaded machine had 0.2 s for that.
    engine = engine_with(bpe_tokenizer, compiler, timeout=0.5)
    try:
        for i in range(COMPILE_WORKERS):  # each times out, its compile abandoned, still running
            with pytest.raises(GrammarCompileTimeoutError):
                [c async for c in engine.add_request([1, i], held(str(i)))]
        late = engine.add_request([2], held("late"))  # no thread for it while the abandoned ones run on
        with pytest.raises(GrammarCompileTimeoutError):
            [c async for c in late]
        assert "holdlate" not in compiler.started and compiler.running == COMPILE_WORKERS
        waiting = asyncio.ensure_future(engine.generate([7], SamplingParams(max_tokens=2, regex="after")))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # every thread is an abandoned compile's
        compiler.release.set()
        assert (await waiting).finish_reason == "length"
        assert (await engine.generate([3], QUICK)).finish_reason == "length"
        await wait_drained(engine)
    finally:
        engine.shutdown()


async def test_an_abort_while_compiling_ends_the_request_at_once(bpe_tokenizer: Any, compiler: HeldCompiler) -> None:
    engine = engine_with(bpe_tokenizer, compiler)
    try:
        stream = engine.add_request([1, 2, 3], held("aborted"), request_id="r")
        await asyncio.to_thread(compiler.wait_started, 1)
        await engine.abort("r")
        chunks = [c async for c in stream]
        assert chunks[-1].finish_reason == "abort"
        compiler.release.set()  # the compile ends afterwards: the request never reaches the core
        await wait_drained(engine)
    finally:
        engine.shutdown()


def _sleeping_check(seconds: float, spec: StructuredOutput) -> None:
    if spec.text.startswith("slow"):
        time.sleep(seconds)


def _sleeping_compiler(tokenizer: Any, seconds: float) -> FakeBuilt:
    built = fake_built(tokenizer, step_delay=0.001)
    built.check_constraint = functools.partial(_sleeping_check, seconds)
    return built


@pytest.mark.asyncio(loop_factories=["asyncio"])  # the core process is tested on asyncio: its pipes, not the loop
async def test_compiles_run_beside_each_other_in_the_core_process(bpe_tokenizer: Any) -> None:
    """With the core in its own process the compiles run there, beside each other too (its checker had one
    thread: the second compile waited for the first, and its wait counted against its timeout)."""
    build = functools.partial(_sleeping_compiler, bpe_tokenizer, 1.0)
    # 1.9 s: compiles one or two at a time end the third at 2 s or later (timed out); three at once end at
    # 1 s, and 0.9 s is left for threads and pipes on a loaded machine (1.6 s left 0.6 s).
    engine = AsyncLLMEngine.from_client(functools.partial(ProcClient, build), grammar_compile_timeout=1.9)
    try:
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(engine.generate([1, i], SamplingParams(max_tokens=2, regex=f"slow{i}")) for i in range(3))
        )
        assert all(o.finish_reason == "length" for o in outs)
        assert time.perf_counter() - start < 1.9  # three 1 s compiles at once, none timed out
    finally:
        engine.shutdown()


def test_each_job_is_done_exactly_once_when_compiles_end_at_their_deadline() -> None:
    """A compile ending as its deadline passes: either its result or the timeout, never both, never neither."""
    results: dict[int, list[str]] = {}
    lock = threading.Lock()
    finished = threading.Semaphore(0)

    def done(job: int, result: str) -> None:
        with lock:
            results.setdefault(job, []).append(result)
        finished.release()

    compiles: Compiles[int, str] = Compiles(
        lambda job: time.sleep(0.01) or "compiled", done, lambda job: "timed out", timeout=0.01, workers=8
    )
    try:
        for job in range(200):
            compiles.submit(job)
        for _ in range(200):
            assert finished.acquire(timeout=10)
        time.sleep(0.05)  # a second `done` would land by now
        assert sorted(results) == list(range(200)) and all(len(r) == 1 for r in results.values())
        assert {r[0] for r in results.values()} <= {"compiled", "timed out"}
    finally:
        compiles.stop()
