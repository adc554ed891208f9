"""The grammar process (`ASYNCLLM_GRAMMAR_PROCESS=on`) through the engine: constrained requests of every kind and
draw, several samples each, overlapped with held draws as on CUDA, chunked and preempted, give the step
thread's tokens (serial scheduling, matchers in the step thread); the engine's shutdown ends the process; if
the process dies, each request whose matcher it held ends with `RequestFailedError` naming it, while the
others finish and later constrained requests are served from the step thread."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from asyncllm import LLM, AsyncLLMEngine, RequestFailedError, SamplingParams
from asyncllm.errors import InvalidConfigError
from tests.async_engine.conftest import wait_drained
from tests.structured.conftest import ENGINE_ARGS, check, constrained, overlapped_engine
from tests.structured.test_engine_paths import _run, _workload


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:  # a thread or process that ended meanwhile
        return b""


def grammar_processes() -> list[int]:
    """The grammar processes this process started (Linux /proc)."""
    tasks = Path(f"/proc/{os.getpid()}/task").iterdir()
    children = [int(c) for task in tasks for c in _read(task / "children").split()]
    return [c for c in children if b"grammar_worker import main" in _read(Path(f"/proc/{c}/cmdline"))]


def test_grammar_process_takes_auto_on_or_off(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "1")
    with pytest.raises(InvalidConfigError, match=r"ASYNCLLM_GRAMMAR_PROCESS.*use one of auto, on, off"):
        LLM(str(tiny_model), **ENGINE_ARGS)
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "on")
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS_THREADS", "0")
    with pytest.raises(InvalidConfigError, match=r"ASYNCLLM_GRAMMAR_PROCESS_THREADS.*use auto or an integer >= 1"):
        LLM(str(tiny_model), **ENGINE_ARGS)


@pytest.mark.slow
async def test_grammar_process_gives_the_step_threads_tokens(
    tiny_model: Path, llm_drawing: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grammar process's matchers never jump forward: its twin is the step thread's without it."""
    prompts, params, names = _workload()
    prompts.append("Hello")
    params.append(constrained("person", "t1", seed=9, n=3))
    names.append("person")
    want = llm_drawing.generate(prompts, params, use_tqdm=False)  # step-thread matchers
    variant = dict(hold_masked_draws=True, num_kv_blocks=56, max_num_batched_tokens=16, max_num_seqs=6)
    # Two threads of its own: a step's rows are shared between them where they are many.
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "on")
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS_THREADS", "2")
    engine = overlapped_engine(tiny_model, **{**ENGINE_ARGS, **variant})
    try:
        await asyncio.wait_for(engine.generate([5], SamplingParams(max_tokens=1)), 60)  # started with the engine
        assert len(grammar_processes()) == 1
        got = await _run(engine, prompts[:-1], params[:-1])
        for (tokens, text, reason), ref, name in zip(got, want, names):
            assert (tokens, text, reason) == (ref.token_ids, ref.text, ref.finish_reason), name
            if name is not None:
                check(name, text)
        samples = await asyncio.wait_for(engine.generate(prompts[-1], params[-1]), 60)
        assert [o.token_ids for o in samples.outputs] == [o.token_ids for o in want[-1].outputs]
        for out in samples.outputs:
            check("person", out.text)
        stats = await wait_drained(engine, timeout=10)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    finally:
        engine.shutdown()
    assert grammar_processes() == [], "the engine's shutdown ends its grammar process"


@pytest.mark.slow
async def test_grammar_process_death_fails_its_requests_alone(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await process_death_fails_its_requests_alone(tiny_model, monkeypatch, **ENGINE_ARGS)


async def process_death_fails_its_requests_alone(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, **engine_args: Any
) -> None:
    """Its body, for any device (on CUDA, draws then wait on the device for the dead process's rows)."""
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "on")
    engine = AsyncLLMEngine(str(tiny_model), **engine_args)
    try:
        await asyncio.wait_for(engine.generate([5], SamplingParams(max_tokens=1)), 60)
        [pid] = grammar_processes()
        long = SamplingParams(regex="[a-z ]{5000}", temperature=1.0, seed=1, max_tokens=500)  # cannot end early
        streams = [engine.stream([5, 6, 7 + i], long) for i in range(3)]
        plain = [asyncio.create_task(engine.generate([9, 10 + i], SamplingParams(max_tokens=40))) for i in range(2)]
        started = [asyncio.Event() for _ in streams]

        async def read(stream: Any, started: asyncio.Event) -> BaseException | None:
            try:
                async for _ in stream:
                    started.set()
            except Exception as exc:  # the error is what the test reads
                return exc
            return None

        readers = [asyncio.create_task(read(s, e)) for s, e in zip(streams, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)  # every stream under way
        os.kill(pid, signal.SIGKILL)
        errors = await asyncio.wait_for(asyncio.gather(*readers), 30)
        for error in errors:
            assert isinstance(error, RequestFailedError), error
            assert f"grammar process (pid {pid})" in str(error) and "SIGKILL" in str(error)
        assert [len((await p).token_ids) for p in plain] == [40, 40]
        later = await asyncio.wait_for(engine.generate("Hello", constrained("regex", "t1", seed=5)), 30)
        check("regex", later.text)
        stats = await wait_drained(engine, timeout=10)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        engine.shutdown()
    assert grammar_processes() == []
