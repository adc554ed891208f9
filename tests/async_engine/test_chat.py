"""`engine.chat` on the tiny model (CPU): the reply streams as `generate` gives it, tools reach the template,
bad tools and choices are refused naming the field, reasoning is split off, forced calls always parse and
satisfy their tool's schema, and leaving a chat early frees everything."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from asyncllm import AsyncLLMEngine, ChatChunk, SamplingParams
from asyncllm.async_engine.chat_session import check_chat
from asyncllm.errors import InvalidRequestError, UnsupportedModelError
from asyncllm.parsing import ReasoningParser, ReasoningTags, merge_tool_call_deltas
from tests.async_engine.conftest import wait_drained
from tests.fixtures.chat_templates import HERMES, THINKING
from tests.fixtures.tiny_models import build_checkpoint

# Tool schemas take many tokens of the tiny tokenizer: a checkpoint with room for them.
ENGINE_ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=512, seed=3)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 8},
        "limit": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["news", "web"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["query", "limit"],
}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    path = build_checkpoint(tmp_path_factory.mktemp("chat") / "qwen3", "qwen3", max_position_embeddings=4096)
    engine = AsyncLLMEngine(str(path), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


async def read(stream: Any) -> list[ChatChunk]:
    chunks = [c async for c in stream]
    assert chunks and chunks[-1].finish_reason is not None
    assert all(c.finish_reason is None and not c.empty for c in chunks[:-1])
    return chunks


def joined(chunks: list[ChatChunk]) -> tuple[str, str]:
    return "".join(c.text for c in chunks), "".join(c.reasoning_text for c in chunks)


async def test_chat_streams_the_answer_generate_gives(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    stream = engine.chat(ASK, params)
    chunks = await read(stream)
    want = await engine.generate(engine.apply_chat_template(ASK), params)
    assert joined(chunks) == (want.text, "")
    assert chunks[-1].finish_reason == want.finish_reason
    assert stream.prompt_token_ids == tuple(want.prompt_token_ids)
    assert stream.metrics is not None and stream.metrics.num_generated_tokens == len(want.token_ids)
    assert not any(c.tool_calls for c in chunks)


async def test_tools_reach_the_template_and_past_calls_are_objects(engine: AsyncLLMEngine) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    stream = engine.chat(messages, SamplingParams(max_tokens=4, seed=1), tools=TOOLS, chat_template=HERMES)
    await read(stream)
    assert engine.tokenizer is not None and stream.prompt_token_ids is not None
    prompt = engine.tokenizer.decode(stream.prompt_token_ids)
    assert json.dumps(TOOLS[1], ensure_ascii=False) in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # not the JSON text quoted again
    assert "<tool_response>sunny</tool_response>" in prompt


async def test_tool_choice_none_lists_the_tools_but_reads_no_call(engine: AsyncLLMEngine) -> None:
    """As vLLM does: the prompt still lists the tools (the model knows them, and the conversation's prefix
    stays the same turn after turn), but a reply is text, even one that looks like a call."""
    params = SamplingParams(temperature=0.0, max_tokens=10)
    stream = engine.chat(ASK, params, tools=TOOLS, tool_choice="none", chat_template=HERMES)
    chunks = await read(stream)
    assert engine.tokenizer is not None and stream.prompt_token_ids is not None
    assert "<tools>" in engine.tokenizer.decode(stream.prompt_token_ids)
    want = await engine.generate(list(stream.prompt_token_ids), params)
    assert joined(chunks) == (want.text, "")
    assert not any(c.tool_calls for c in chunks) and chunks[-1].finish_reason == want.finish_reason
    lookalike = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    forced = SamplingParams(choice=[lookalike], max_tokens=200)  # a constraint is the caller's again
    chunks = await read(engine.chat(ASK, forced, tools=TOOLS, tool_choice="none", chat_template=HERMES))
    assert joined(chunks) == (lookalike, "") and chunks[-1].finish_reason == "stop"
    assert not any(c.tool_calls for c in chunks)


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize(
    ("tools", "tool_choice", "match"),
    [
        ({"type": "function"}, "auto", r"tools must be a list"),
        (["f"], "auto", r"tools\[0\] must be a dict"),
        ([{"type": "code", "function": {"name": "f"}}], "auto", r"tools\[0\]\.type must be 'function'"),
        ([{"type": "function"}], "auto", r"tools\[0\]\.function must be a dict"),
        ([_tool(name="a b")], "auto", r"tools\[0\]\.function\.name must be 1-64 letters"),
        ([_tool(name="x" * 65)], "auto", r"tools\[0\]\.function\.name"),
        ([_tool(), _tool()], "auto", r"tools\[1\]\.function\.name 'f' is already"),
        ([_tool(description=3)], "auto", r"tools\[0\]\.function\.description must be a str"),
        ([_tool(parameters="{}")], "auto", r"tools\[0\]\.function\.parameters must be a JSON schema"),
        ([_tool(parameters={"type": "array"})], "auto", r"tools\[0\]\.function\.parameters must describe an object"),
        (
            [_tool(parameters={"default": float("nan")})],
            "auto",
            r"tools\[0\]\.function\.parameters is not serialisable",
        ),
        ([_tool()], "always", r"tool_choice must be 'auto', 'none', 'required' or"),
        ([_tool()], {"type": "function", "function": {"name": "g"}}, r"tool_choice names the tool 'g', which tools"),
        ([_tool()], {"type": "function"}, r"tool_choice must be"),
        (None, "required", r"tool_choice='required' needs tools"),
        ([], {"type": "function", "function": {"name": "f"}}, r"tool_choice names the tool 'f'.*\(none\)"),
    ],
)
async def test_bad_tools_and_choices_raise_at_once_naming_the_field(
    engine: AsyncLLMEngine, tools: Any, tool_choice: Any, match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        engine.chat(ASK, tools=tools, tool_choice=tool_choice, chat_template=HERMES)
    assert engine.num_live_requests == 0


async def test_other_bad_chat_arguments_raise_at_once(engine: AsyncLLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match=r"params\.json_schema and tools cannot be combined"):
        engine.chat(ASK, SamplingParams(json_schema=WEATHER), tools=TOOLS, chat_template=HERMES)
    engine.chat(ASK, SamplingParams(json_schema=WEATHER), tools=TOOLS, tool_choice="none").close()  # tools unused
    for params in (SamplingParams(ignore_eos=True), SamplingParams(min_tokens=2)):  # the grammar ends with EOS
        with pytest.raises(InvalidRequestError, match=r"params\.(ignore_eos|min_tokens) and tools cannot be combined"):
            engine.chat(ASK, params, tools=TOOLS, chat_template=HERMES)
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\['content'\] must be a str"):
        engine.chat([{"role": "user", "content": None}])
    with pytest.raises(InvalidRequestError, match="params must be a SamplingParams"):
        engine.chat(ASK, {"temperature": 0})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"params\.prompt_logprobs is not offered by chat"):
        engine.chat(ASK, SamplingParams(prompt_logprobs=1))
    with pytest.raises(InvalidRequestError, match="parallel_tool_calls must be a bool"):
        engine.chat(ASK, tools=TOOLS, parallel_tool_calls=None, chat_template=HERMES)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs must be a dict"):
        engine.chat(ASK, chat_template_kwargs=["enable_thinking"])  # type: ignore[arg-type]
    # Bug: `tokenize` (or `chat_template`) among the variables reached transformers as its own argument.
    for key in ("tokenize", "chat_template", "return_dict"):
        with pytest.raises(InvalidRequestError, match=f"chat_template_kwargs: '{key}' is an argument of the"):
            engine.chat(ASK, chat_template_kwargs={key: True})
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs: 'a-b' is not a template variable"):
        engine.chat(ASK, chat_template_kwargs={"a-b": 1})
    # The tiny model's own template is ChatML without a tool-call format.
    with pytest.raises(UnsupportedModelError, match="no tool-call format"):
        engine.chat(ASK, tools=TOOLS)
    assert engine.num_live_requests == 0


async def test_what_needs_the_template_raises_from_the_first_chunk(engine: AsyncLLMEngine) -> None:
    bad_pattern = [_tool(parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}})]
    stream = engine.chat(ASK, tools=bad_pattern, tool_choice="required", chat_template=HERMES)
    with pytest.raises(InvalidRequestError, match=r"tools\[0\]\.function\.parameters .*parenthesis"):
        await stream.__anext__()
    refusing = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="the chat template refused these messages: roles must alternate"):
        await engine.chat(ASK, chat_template=refusing).__anext__()
    with pytest.raises(StopAsyncIteration):  # a stream that failed is over
        await stream.__anext__()
    await wait_drained(engine)


@pytest.mark.parametrize(
    ("template", "tool_parser", "reasoning"),
    [
        (HERMES, "hermes", None),
        (THINKING, "hermes", ReasoningTags()),
        ("{{ '<|start_header_id|>' + m.role }}", "llama3_json", None),
        ("{{ '[TOOL_CALLS][' }}", "mistral", None),
        ("{{ '<｜Assistant｜><think>\\n' }} <|python_tag|>", "llama3_json", ReasoningTags()),
    ],
)
def test_parsers_are_chosen_from_the_template(template: str, tool_parser: str, reasoning: Any) -> None:
    class Tokenizer:
        chat_template = template

    request = check_chat(Tokenizer(), ASK, None, TOOLS, "auto", True, None, None)  # type: ignore[arg-type]
    assert (request.parsers.tool_parser, request.parsers.reasoning) == (tool_parser, reasoning)


def test_without_template_markers_the_architecture_decides() -> None:
    class Tokenizer:
        chat_template = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"

    request = check_chat(Tokenizer(), ASK, None, TOOLS, "auto", True, None, None, "Qwen3ForCausalLM")  # type: ignore[arg-type]
    assert request.parsers.tool_parser == "hermes"
    with pytest.raises(UnsupportedModelError, match="no tool-call format"):
        check_chat(Tokenizer(), ASK, None, TOOLS, "auto", True, None, None, "GPT2LMHeadModel")  # type: ignore[arg-type]


async def test_reasoning_is_split_off_for_a_thinking_template(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=16)
    stream = engine.chat(ASK, params, chat_template=THINKING)
    chunks = await read(stream)
    assert stream.prompt_token_ids is not None
    raw = (await engine.generate(list(stream.prompt_token_ids), params)).text
    parser = ReasoningParser(start_in_reasoning=True)  # the prompt ends inside <think>
    whole = parser.feed(raw), parser.finish()
    assert joined(chunks) == ("".join(d.content for d in whole), "".join(d.reasoning for d in whole))
    assert joined(chunks)[1]


@pytest.mark.parametrize("how", ["break", "cancel", "aclose", "abort"])
async def test_leaving_a_chat_early_aborts_it_and_frees_its_blocks(engine: AsyncLLMEngine, how: str) -> None:
    # With tools the reply is constrained (and may end at EOS); the abort test needs a reply that cannot end.
    params = SamplingParams(max_tokens=400, seed=1)
    if how == "abort":
        stream = engine.chat(ASK, SamplingParams(max_tokens=400, ignore_eos=True))
    else:
        stream = engine.chat(ASK, params, tools=TOOLS, chat_template=HERMES)
    if how == "break":
        async for _ in stream:
            break
        del stream
    elif how == "cancel":
        task = asyncio.create_task(read(stream))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait([task])
        assert task.cancelled() or task.exception() is None
    elif how == "aclose":
        await stream.__anext__()
        await stream.aclose()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    else:
        await stream.__anext__()
        await engine.abort(stream.request_id)
        chunks = [c async for c in stream]
        assert chunks[-1].finish_reason == "abort"
    stats = await wait_drained(engine, timeout=10)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_cancelled_while_templating_adds_nothing(engine: AsyncLLMEngine) -> None:
    task = asyncio.create_task(engine.chat(ASK, SamplingParams(max_tokens=400, ignore_eos=True)).__anext__())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task])
    await asyncio.sleep(0.1)  # the template thread finishes; nothing may reach the engine after it
    await wait_drained(engine)


def check_calls(chunks: list[ChatChunk], names: set[str]) -> list[Any]:
    calls = merge_tool_call_deltas(d for c in chunks for d in c.tool_calls)
    for call in calls:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert len({c.id for c in calls}) == len(calls)
    return calls


@pytest.mark.needs_structured_output
@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [("required", False), ({"type": "function", "function": {"name": "search"}}, True)],
)
async def test_a_forced_call_always_parses_and_satisfies_its_schema(
    engine: AsyncLLMEngine, tool_choice: Any, parallel: bool
) -> None:
    names = {"search"} if isinstance(tool_choice, dict) else set(SCHEMAS)
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=300)
        stream = engine.chat(
            ASK, params, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel, chat_template=HERMES
        )
        chunks = await read(stream)
        assert chunks[-1].finish_reason == "tool_calls", (seed, chunks)
        assert len(check_calls(chunks, names)) == 1 and not joined(chunks)[0].strip()


@pytest.mark.needs_structured_output
async def test_required_parallel_calls_all_parse(engine: AsyncLLMEngine) -> None:
    """A random model may call again and again until max_tokens: every call it finished is whole and valid."""
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=300)
        chunks = await read(engine.chat(ASK, params, tools=TOOLS, tool_choice="required", chat_template=HERMES))
        assert check_calls(chunks, set(SCHEMAS)), (seed, chunks)
        assert chunks[-1].finish_reason in ("tool_calls", "length")
        if chunks[-1].finish_reason == "tool_calls":
            assert not joined(chunks)[0].strip()


def test_chat_runs_on_trio(engine: AsyncLLMEngine) -> None:
    """Templating runs in trio's worker thread; a cancelled scope aborts the chat."""
    import trio

    params = SamplingParams(temperature=0.0, max_tokens=6)

    async def main() -> tuple[str, str]:
        chunks = [c async for c in engine.chat(ASK, params, tools=TOOLS, chat_template=HERMES)]
        with trio.move_on_after(0.2):
            async for _ in engine.chat(ASK, SamplingParams(ignore_eos=True, max_tokens=400)):
                pass
        return "".join(c.text for c in chunks), chunks[-1].finish_reason or ""

    text, finish = trio.run(main)
    assert finish in ("stop", "length") and isinstance(text, str)
    asyncio.run(wait_drained(engine, timeout=10))


async def test_chat_takes_a_priority(engine: AsyncLLMEngine) -> None:
    """`engine.chat(..., priority=...)` reaches the request (issue 22); a bad one is refused at the call."""
    with pytest.raises(InvalidRequestError, match=r"priority='urgent' is invalid"):
        engine.chat(ASK, SamplingParams(max_tokens=2), priority="urgent")  # type: ignore[arg-type]
    chunks = [c async for c in engine.chat(ASK, SamplingParams(max_tokens=3, ignore_eos=True), priority=-2)]
    assert chunks[-1].finish_reason == "length"


async def test_a_chat_takes_a_timeout(engine: AsyncLLMEngine) -> None:
    """`chat(..., timeout=)` reaches the request: the reply ends with "timeout" (or, with no output yet,
    `RequestTimeoutError`), and its blocks are freed."""
    from asyncllm.errors import RequestTimeoutError

    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    try:
        chunks = [c async for c in engine.chat(ASK, params, timeout=0.2)]
        assert chunks[-1].finish_reason == "timeout"
    except RequestTimeoutError:
        pass
    stats = engine.stats()
    assert stats["num_running"] == 0
