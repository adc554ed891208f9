"""LoRA adapters through `AsyncLLMEngine` (tiny Qwen3 on CPU): adapters added and removed while streams of the
base model and of adapters run, every stream still giving exactly the PEFT-merged model's tokens; a removal
of an adapter in use refused (naming how many use it) and one not in use done at once; requests naming
unknown adapters refused in the caller's thread; `chat` through an adapter; a dead engine refusing calls."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from asyncllm import AsyncLLMEngine, EngineDeadError, InvalidRequestError, LoRAError, SamplingParams
from tests.async_engine.conftest import wait_drained
from tests.fixtures.lora_adapters import merged_greedy

ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=8
)
PROMPT = [17, 4, 250, 99, 8, 61, 120]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model: Path, tiny_lora_adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    out = {None: merged_greedy(tiny_model, None, [PROMPT], MAX_TOKENS)[0]}
    for name in ("a", "b"):
        out[name] = merged_greedy(tiny_model, tiny_lora_adapters[name], [PROMPT], MAX_TOKENS)[0]
    return out


async def _tokens(stream: Any) -> list[int]:
    return [t async for chunk in stream for t in chunk.token_ids]


@pytest.fixture(params=[False, True], ids=["step-thread", "core-process"])
def core_process(request: pytest.FixtureRequest) -> bool:
    """The calls cross a core process's pipe too (their errors with their types and messages); on asyncio
    only, the loop library being the front's business."""
    if request.param and "uvloop" in request.node.name:
        pytest.skip("the core process is tested on asyncio")
    return bool(request.param)


@pytest.mark.slow
async def test_adding_and_removing_adapters_while_streams_run_loses_nothing(
    tiny_model: Path, tiny_lora_adapters: dict[str, Path], expected, core_process: bool
) -> None:
    engine = AsyncLLMEngine(str(tiny_model), **ARGS, core_process=core_process)
    try:
        await engine.add_lora("a", tiny_lora_adapters["a"])
        await engine.add_lora("c", tiny_lora_adapters["c"])
        first = [asyncio.Event(), asyncio.Event()]

        async def read(index: int, lora: str | None) -> list[int]:
            tokens = []
            async for chunk in engine.stream(PROMPT, GREEDY, lora=lora):
                tokens += chunk.token_ids
                first[index].set()
            return tokens

        # Long streams that outlive every change below (aborted at the end): "a" is in use throughout.
        hold = SamplingParams(max_tokens=400, ignore_eos=True)
        held = [asyncio.create_task(_tokens(engine.stream(PROMPT, hold, f"hold-{n}", lora=n))) for n in ("a", None)]
        running = [asyncio.create_task(read(0, None)), asyncio.create_task(read(1, "a"))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 30)
        await engine.add_lora("b", tiny_lora_adapters["b"])  # while both stream
        late = asyncio.create_task(_tokens(engine.stream(PROMPT, GREEDY, lora="b")))
        with pytest.raises(LoRAError, match=r"'a' is in use by [12] live request\(s\)"):
            await engine.remove_lora("a")
        await engine.remove_lora("c")  # nobody uses it: removed while the others stream
        with pytest.raises(InvalidRequestError, match=r"lora='c' is not an added LoRA adapter \(added: 'a', 'b'\)"):
            engine.add_request(PROMPT, GREEDY, lora="c")
        base, with_a, with_b = await asyncio.wait_for(asyncio.gather(*running, late), 60)
        assert (base, with_a, with_b) == (expected[None], expected["a"], expected["b"])
        assert not any(task.done() for task in held), "the holders should outlive the changes"
        for n in ("a", None):
            await engine.abort(f"hold-{n}")
        await asyncio.gather(*held)
        await wait_drained(engine)
        await engine.remove_lora("a")
        assert engine.list_loras() == ["b"]
    finally:
        await engine.aclose()


@pytest.mark.slow
async def test_requests_and_calls_are_checked_in_the_callers_thread(
    tiny_model: Path, tiny_lora_adapters, core_process: bool
) -> None:
    engine = AsyncLLMEngine(str(tiny_model), **ARGS, core_process=core_process)
    try:
        with pytest.raises(InvalidRequestError, match="lora=5 is invalid"):
            engine.add_request(PROMPT, GREEDY, lora=5)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match=r"lora='a' is not an added LoRA adapter \(added: none\)"):
            engine.add_request("Hello", GREEDY, lora="a")
        with pytest.raises(LoRAError, match="name='' is invalid"):
            await engine.add_lora("", tiny_lora_adapters["a"])
        with pytest.raises(LoRAError, match="no LoRA adapter named 'a' is added"):
            await engine.remove_lora("a")
        with pytest.raises(LoRAError, match=r"cannot add LoRA adapter 'a': no LoRA adapter at .*adapter_config\.json"):
            await engine.add_lora("a", tiny_model)  # a checkpoint, not an adapter
        assert engine.list_loras() == [] and engine.num_live_requests == 0
    finally:
        await engine.aclose()
    with pytest.raises(EngineDeadError):
        await engine.add_lora("a", tiny_lora_adapters["a"])


async def test_chat_through_an_adapter(tiny_model: Path, tiny_lora_adapters) -> None:
    engine = AsyncLLMEngine(str(tiny_model), **ARGS)
    try:
        await engine.add_lora("a", tiny_lora_adapters["a"])
        messages = [{"role": "user", "content": "Hello"}]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        text = "".join([c.text async for c in engine.chat(messages, params, lora="a")])
        ids = engine.apply_chat_template(messages)
        assert text == (await engine.generate(ids, params, lora="a")).text
        assert text != (await engine.generate(ids, params)).text
    finally:
        await engine.aclose()


async def test_an_engine_without_lora_refuses_adapters(tiny_model: Path, tiny_lora_adapters) -> None:
    engine = AsyncLLMEngine(str(tiny_model), device="cpu", dtype="float32", num_kv_blocks=64)
    try:
        with pytest.raises(LoRAError, match="built without enable_lora=True"):
            await engine.add_lora("a", tiny_lora_adapters["a"])
        with pytest.raises(InvalidRequestError, match="built without enable_lora=True"):
            engine.add_request(PROMPT, GREEDY, lora="a")
        assert engine.list_loras() == []
    finally:
        await engine.aclose()
