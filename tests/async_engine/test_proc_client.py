"""The engine core in a process of its own (`ProcClient`): what only a second process can break. An abort
sent while the core's forward pass runs gets no token from it; one request's failure crosses the pipe as
its own error, cause and all; a constraint is compiled in the core process; a load error is re-raised in
the front with its type; a core that fails, or whose process is killed, ends every stream at once with
`EngineDeadError`; a front that dies takes its core with it; a clean shutdown leaves no process. (The
contract shared with the in-process client runs in the tests marked `core_process`.)"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from asyncllm import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStalledError,
    InvalidRequestError,
    RequestFailedError,
    SamplingParams,
)
from asyncllm.async_engine.core_client import EngineCoreClient
from asyncllm.async_engine.proc_client import CoreProcessDiedError, ProcClient
from asyncllm.async_engine.router import OutputRouter
from asyncllm.core.output_processor import RequestDelta
from asyncllm.errors import InvalidConfigError
from asyncllm.structured import StructuredOutput
from tests.async_engine.conftest import wait_drained
from tests.fixtures.fake_core import FakeBuilt, fake_built, offline_run
from tests.fixtures.fake_executor import InjectedFailure, hash_next_token, reference_tokens

# The pipes are the same whatever loop the front runs (the tests marked core_process cover the front).
_ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])
_LONG = dict(max_model_len=4096, step_delay=0.002)
_ENDLESS = SamplingParams(max_tokens=4000, ignore_eos=True)


def _engine(build: Any) -> tuple[AsyncLLMEngine, ProcClient]:
    made: list[ProcClient] = []

    def make(router: OutputRouter) -> EngineCoreClient:
        made.append(ProcClient(build, router))
        return made[-1]

    return AsyncLLMEngine.from_client(make), made[0]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


# ---------------------------------------------------------------- builders the core process runs (picklable)
class _Gate:
    """A next-token function that, at one sequence length, says so (a file) and waits for leave (another)."""

    def __init__(self, folder: str, at_len: int, vocab: int) -> None:
        self.folder, self.at_len, self.vocab = folder, at_len, vocab

    def __call__(self, tokens: Any) -> int:
        if len(tokens) == self.at_len:
            Path(self.folder, "reached").touch()
            while not Path(self.folder, "release").exists():
                time.sleep(0.001)
        return hash_next_token(self.vocab, frozenset({0}))(tokens)


def _failing_load() -> FakeBuilt:
    raise InvalidConfigError("num_kv_blocks=0 is invalid: give an integer >= 1")


def _failing_step(tokenizer: Any, after_steps: int) -> FakeBuilt:
    built = fake_built(tokenizer, **_LONG)  # type: ignore[arg-type]
    built.executor.fail_after_steps = after_steps
    return built


class _AdmitFails:
    def __init__(self, core: Any, bad: str) -> None:
        self._core, self._bad = core, bad

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def add_request(self, request: Any) -> None:
        self._core.add_request(request)
        if request.request_id == self._bad:
            raise ValueError("DecodeStream refused this prompt")


def _admit_fails(tokenizer: Any, bad: str) -> FakeBuilt:
    built = fake_built(tokenizer, step_delay=0.001)
    return FakeBuilt(_AdmitFails(built.core, bad), built.tokenizer, built.runtime, built.executor, built.encode)  # type: ignore[arg-type]


def _refuse_regex(spec: StructuredOutput) -> None:
    if spec.field == "regex":
        raise InvalidRequestError(f"SamplingParams.regex={spec.text!r} does not compile: unbalanced parenthesis")


def _checking(tokenizer: Any) -> FakeBuilt:
    built = fake_built(tokenizer, step_delay=0.001)
    built.check_constraint = _refuse_regex
    return built


# ---------------------------------------------------------------- the tests
@_ASYNCIO
async def test_abort_during_the_cores_forward_pass_gets_no_token_from_it(bpe_tokenizer: Any, tmp_path: Path) -> None:
    prompt = [3, 4, 5]
    gate = _Gate(str(tmp_path), len(prompt) + 7, 384)  # blocks the forward pass that samples the 8th token
    engine, _ = _engine(functools.partial(fake_built, bpe_tokenizer, next_token=gate, max_model_len=4096))
    try:
        stream = engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
        reader = asyncio.create_task(_collect(stream))
        deadline = time.monotonic() + 5
        while not (tmp_path / "reached").exists():
            assert time.monotonic() < deadline, "the core never reached the gated step"
            await asyncio.sleep(0.001)
        await engine.abort(stream.request_id)  # while the core's forward pass runs
        # ... and reaches the core process before the step ends: nothing observable says when, so a wide
        # margin (a pipe message takes microseconds; 0.05 s was tight on a loaded machine).
        await asyncio.sleep(0.5)
        (tmp_path / "release").touch()
        chunks = await asyncio.wait_for(reader, 5)
        tokens = [t for c in chunks for t in c.token_ids]
        assert chunks[-1].finish_reason == "abort" and chunks[-1].metrics is not None
        assert tokens == reference_tokens(hash_next_token(384, frozenset({0})), prompt, 20, frozenset())[:7]
        stats = await wait_drained(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and engine.is_running
    finally:
        engine.shutdown()


async def _collect(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


@_ASYNCIO
async def test_a_request_the_core_cannot_admit_fails_alone_with_its_cause(bpe_tokenizer: Any) -> None:
    engine, _ = _engine(functools.partial(_admit_fails, bpe_tokenizer, "bad"))
    try:
        good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=10))
        with pytest.raises(RequestFailedError, match=r"failed to admit this request.*DecodeStream refused") as info:
            await engine.generate([4, 5, 6], SamplingParams(max_tokens=10), request_id="bad")
        assert isinstance(info.value.__cause__, ValueError)  # the core's own error, carried over the pipe
        assert [c async for c in good][-1].finish_reason == "length"
        await wait_drained(engine)
        assert engine.is_running
    finally:
        engine.shutdown()


@_ASYNCIO
async def test_constraints_compile_in_the_core_process(bpe_tokenizer: Any) -> None:
    engine, _ = _engine(functools.partial(_checking, bpe_tokenizer))
    try:
        with pytest.raises(InvalidRequestError, match=r"regex='\(a' does not compile"):
            await engine.generate([1, 2, 3], SamplingParams(max_tokens=4, regex="(a"))
        (want,) = offline_run(fake_built(bpe_tokenizer), [[1, 2, 3]], [SamplingParams(max_tokens=4)])
        out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=4, choice=["x", "y"]))
        assert out.token_ids == want[0]  # accepted by the check (the fake runner does not enforce it)
    finally:
        engine.shutdown()


def test_a_load_error_is_raised_in_the_front_with_its_type() -> None:
    made: list[ProcClient] = []

    def make(router: OutputRouter) -> EngineCoreClient:
        made.append(ProcClient(_failing_load, router))
        return made[-1]

    with pytest.raises(InvalidConfigError, match="num_kv_blocks=0"):
        AsyncLLMEngine.from_client(make)
    pid = made[0].pid
    assert pid is not None and _gone(pid, 5)


def test_a_builder_that_cannot_reach_the_core_is_named() -> None:
    """A builder that does not pickle is refused before any process starts; one the core process cannot
    load (defined in a module only the front has) fails its start with the core's own error."""
    with pytest.raises(TypeError, match="must pickle"):
        _engine(lambda: fake_built(None))
    ghost = types.ModuleType("asyncllm_ghost_module")
    exec("def build():\n    raise AssertionError('never runs')\n", ghost.__dict__)
    sys.modules[ghost.__name__] = ghost
    try:
        with pytest.raises(ModuleNotFoundError, match="asyncllm_ghost_module"):
            _engine(ghost.build)
    finally:
        del sys.modules[ghost.__name__]


@_ASYNCIO
async def test_a_failed_step_in_the_core_kills_every_stream_and_the_process_exits(bpe_tokenizer: Any) -> None:
    engine, client = _engine(functools.partial(_failing_step, bpe_tokenizer, 20))
    try:
        streams = [engine.add_request([i + 1, 2], _ENDLESS) for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineDeadError, match="step loop failed") as info:
                async for _ in stream:
                    pass
            assert isinstance(info.value.__cause__, InjectedFailure)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            engine.add_request([1, 2], SamplingParams(max_tokens=2))
        assert client.pid is not None and _gone(client.pid, 10)  # the core released its device and left
        deadline = time.monotonic() + 10  # the front's reading thread ends once it has read the core's exit
        while engine.step_thread_alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.step_thread_alive
    finally:
        engine.shutdown()


@_ASYNCIO
async def test_a_killed_core_process_ends_every_stream_at_once(bpe_tokenizer: Any) -> None:
    engine, client = _engine(functools.partial(fake_built, bpe_tokenizer, **_LONG))
    try:
        streams = [engine.add_request([i + 1, 2], _ENDLESS) for i in range(4)]
        for stream in streams:
            await stream.__anext__()
        assert client.pid is not None
        os.kill(client.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError) as info:
                async for _ in stream:
                    pass
            assert isinstance(info.value.__cause__, CoreProcessDiedError)
            assert "killed by signal SIGKILL" in str(info.value.__cause__)
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            engine.add_request([1, 2], SamplingParams(max_tokens=2))
    finally:
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 2.0


@_ASYNCIO
async def test_a_long_step_shows_in_health_and_shutdown_leaves_no_process(bpe_tokenizer: Any, tmp_path: Path) -> None:
    gate = _Gate(str(tmp_path), 3 + 2, 384)
    engine, client = _engine(functools.partial(fake_built, bpe_tokenizer, next_token=gate, max_model_len=4096))
    stream = engine.add_request([3, 4, 5], SamplingParams(max_tokens=10, ignore_eos=True))
    deadline = time.monotonic() + 5
    while not (tmp_path / "reached").exists():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.05)
    assert engine.step_seconds >= 0.04  # the core process's step in flight, read from shared memory
    with pytest.raises(EngineStalledError, match="step has been running"):
        await engine.check_health(max_step_seconds=0.01)
    (tmp_path / "release").touch()
    assert [c async for c in stream][-1].finish_reason == "length"
    assert engine.step_seconds == 0.0
    await engine.check_health(max_step_seconds=0.01)
    pending = engine.add_request([8, 9], _ENDLESS)
    await asyncio.wait_for(engine.aclose(), 10)
    with pytest.raises(EngineDeadError, match="shut down"):
        async for _ in pending:
            pass
    assert client.pid is not None and _gone(client.pid, 5) and not engine.is_running


_FRONT = """
import functools, os, sys
sys.path.insert(0, {root!r})
from asyncllm import AsyncLLMEngine
from asyncllm.async_engine.proc_client import ProcClient
from tests.fixtures.fake_core import fake_built
made = []
build = functools.partial(fake_built, None)
engine = AsyncLLMEngine.from_client(lambda router: made.append(ProcClient(build, router)) or made[-1])
print(made[0].pid, flush=True)
os._exit(0)
"""


@pytest.mark.slow
def test_a_front_that_dies_takes_its_core_with_it() -> None:
    root = str(Path(__file__).resolve().parents[2])
    script = _FRONT.format(root=root)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert _gone(int(out.stdout.split()[0]), 5), "the core process outlived its front"


def test_the_wire_keeps_a_steps_order_and_its_errors_causes() -> None:
    from asyncllm.async_engine.core_wire import EXTRA_FIELDS, decode_step, encode_step

    columns = {"request_id", "new_token_ids", "new_text"}
    assert {f.name for f in dataclasses.fields(RequestDelta)} == columns | set(EXTRA_FIELDS)  # a new field: wire it

    failed = RequestFailedError("the engine failed to admit this request")
    failed.__cause__ = ValueError("DecodeStream refused this prompt")
    deltas = [
        RequestDelta("a", [5], "x"),
        RequestDelta("b", [], "", "abort", error=failed),
        RequestDelta("a", [6, 7], "yz"),
        RequestDelta("c", [8], "w", index=1),
        RequestDelta("d", [9], "v"),
        RequestDelta("e", [3], "u", prompt_logprobs=[None, {3: -0.5}]),
    ]
    import pickle

    started, stats, back = decode_step(pickle.loads(pickle.dumps(encode_step(["c"], {"num_running": 3}, deltas))))
    assert started == ["c"] and stats["num_running"] == 3
    assert back == deltas[:1] + back[1:2] + deltas[2:]  # every field of every delta, in order
    assert back[-1].prompt_logprobs == [None, {3: -0.5}]
    assert isinstance(back[1].error, RequestFailedError) and isinstance(back[1].error.__cause__, ValueError)
