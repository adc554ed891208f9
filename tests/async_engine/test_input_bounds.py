"""A chat's input is bounded before the template or the tokenizer reads it (issue 39): lone surrogates,
messages longer than any prompt the engine holds, tools and template variables nested too deep are refused
at once, naming the field; and neither a refused 10 MB message nor an allowed one the tokenizer must read
holds the caller's event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncllm import AsyncLLMEngine, InvalidRequestError, SamplingParams
from asyncllm.core.detokenizer import backend_tokenizer
from tests.async_engine.conftest import wait_drained
from tests.fixtures.fake_core import fake_built
from tests.fixtures.tiny_models import build_tokenizer

MAX_GAP_S = 0.05  # the bound on the loop's worst gap while a large message is handled
PARAMS = SamplingParams(max_tokens=2)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny checkpoints' tokenizer as transformers loads it: it has the chat template."""
    return build_tokenizer(tmp_path_factory.mktemp("hf-tok"))


@pytest.fixture
def make_chat_engine(hf_tokenizer: Any) -> Iterator[Callable[..., AsyncLLMEngine]]:
    """`make(max_model_len)`: an engine around a fake core whose front has the tokenizer's chat template."""
    engines: list[AsyncLLMEngine] = []

    def make(max_model_len: int = 256) -> AsyncLLMEngine:
        built = fake_built(backend_tokenizer(hf_tokenizer), max_model_len=max_model_len, block_size=32)
        built = dataclasses.replace(built, tokenizer=hf_tokenizer)  # the front templates with it
        engine = AsyncLLMEngine.from_builder(lambda: built)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


async def worst_loop_gap(work: Callable[[], Awaitable[None]]) -> float:
    """The longest the running loop went without running a 1 ms ticker while `work()` ran."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    try:
        await work()
    finally:
        done.set()
        await ticker
    return max(gaps)


async def read_all(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "user", "content": "a\ud800b"}, r"messages\[0\]\['content'\]"),
        ({"role": "user", "content": "ok", "name": "\udc00"}, r"messages\[0\]\['name'\]"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "\ud83d"}}]},
            r"messages\[0\]\['tool_calls'\]\[0\]\['function'\]\['arguments'\]",
        ),
    ],
)
async def test_lone_surrogates_in_messages_are_refused_at_once(
    make_chat_engine: Callable[..., AsyncLLMEngine], message: dict[str, Any], field: str
) -> None:
    """Regression (issue 39, finding 3): "a\\ud800b" in a chat message reached the tokenizer, whose
    `TypeError: TextInputSequence must be str` came out of engine.chat (and a 500 from the server)."""
    engine = make_chat_engine()
    with pytest.raises(InvalidRequestError, match=f"{field} is not valid Unicode text: surrogates not allowed"):
        engine.chat([message], PARAMS)
    assert engine.num_live_requests == 0
    await read_all(engine.chat([{"role": "user", "content": "after"}], PARAMS))  # the engine carries on


async def test_messages_longer_than_any_prompt_are_refused_before_templating(
    make_chat_engine: Callable[..., AsyncLLMEngine],
) -> None:
    engine = make_chat_engine()
    limit = engine.prompt_bounds.max_chars
    assert limit is not None and limit == engine.prompt_bounds.max_tokens * 13  # the tiny vocabulary: 13 per token
    with pytest.raises(InvalidRequestError, match=f"messages is too large: more than {limit:,} characters"):
        half = limit // 2
        engine.chat([{"role": "system", "content": "x" * half}, {"role": "user", "content": "y" * half}])
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs is too large"):
        engine.chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"notes": "z" * limit})


def nested(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": [value]}
    return value


async def test_deep_tools_and_template_variables_are_refused_not_a_recursion_error(
    make_chat_engine: Callable[..., AsyncLLMEngine],
) -> None:
    """Regression (issue 39, finding 4): a tool's parameters nested ~1,000 deep made json.dumps recurse."""
    engine = make_chat_engine()
    ask = [{"role": "user", "content": "hi"}]
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", **nested(500)}}}
    with pytest.raises(InvalidRequestError, match=r"tools\[0\]\['function'\]\['parameters'\].* nests deeper than"):
        engine.chat(ask, tools=[deep_tool])
    with pytest.raises(InvalidRequestError, match=r"chat_template_kwargs\['v'\].* nests deeper than 64 levels"):
        engine.chat(ask, chat_template_kwargs={"v": nested(500)})
    with pytest.raises(InvalidRequestError, match=r"tool_choice must be"):  # its echo cut short, not a repr crash
        engine.chat(ask, tools=[], tool_choice=nested(2_000))
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\['extra'\].* nests deeper"):
        engine.chat([{"role": "user", "content": "hi", "extra": nested(500)}])


async def test_a_10_mb_message_refused_by_size_leaves_the_loop_free(
    make_chat_engine: Callable[..., AsyncLLMEngine],
) -> None:
    """Regression (issue 39, finding 1): a 10 MB message held the loop for seconds while it was tokenized."""
    engine = make_chat_engine()
    huge = "b " * 5_000_000

    async def refused() -> None:
        with pytest.raises(InvalidRequestError, match="messages is too large"):
            engine.chat([{"role": "user", "content": huge}], PARAMS)

    assert await worst_loop_gap(refused) < MAX_GAP_S


async def test_an_allowed_message_is_templated_and_tokenized_off_the_loop(
    make_chat_engine: Callable[..., AsyncLLMEngine],
) -> None:
    """A message within the character bound whose tokens overflow the longest sequence: the tokenizer reads all
    of it (a quarter of a second here) in a thread that lets go of the GIL, and its ids never become a list."""
    engine = make_chat_engine(max_model_len=20_000)
    limit = engine.prompt_bounds.max_chars
    assert limit is not None
    text = "é" * (limit - 1_000)  # a token per character: 13 times more tokens than fit

    async def refused_once_tokenized() -> None:
        with pytest.raises(InvalidRequestError, match=r"messages: the templated conversation has [\d,]+ tokens"):
            await read_all(engine.chat([{"role": "user", "content": text}], PARAMS))

    assert await worst_loop_gap(refused_once_tokenized) < MAX_GAP_S
    await read_all(engine.chat([{"role": "user", "content": "é" * 1_000}], PARAMS))
    await wait_drained(engine)


def test_bounds_follow_the_engine(make_chat_engine: Callable[..., AsyncLLMEngine], tmp_path: Path) -> None:
    engine = make_chat_engine(max_model_len=1_000)
    assert engine.prompt_bounds.max_tokens == 1_000
    assert engine.prompt_bounds.max_chars == 13_000
