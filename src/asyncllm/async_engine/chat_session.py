"""One chat request's flow: messages and tools through the chat template, the tool-call grammar as the
request's constraint, the reply's text through the chat parsers, `ChatChunk`s out.

What is cheap and needs no tokenizer is checked in the caller's thread (`check_chat`); templating, encoding
and building the grammar (`plan_chat`) run in a worker thread, never on the loop. `engine.chat` and the
server's chat endpoint share these two steps: the first streams a request's replies (`ChatStream`, on its
first `__anext__`; n samples are one engine request, each reply read by its own parser), the second submits
a plan's samples itself. The request is an ordinary engine request
(`RequestStream`), which owns cancellation. Knows the parsers
(`asyncllm.parsing`) and the grammar builder (`structured_output/tool_grammar.py`, imported in that thread:
it brings in xgrammar, hence torch) only through their interfaces; nothing of the core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from asyncllm.async_engine.chat_tools import ChatTools, check_tools
from asyncllm.async_engine.ids import check_request_id, new_request_id
from asyncllm.async_engine.loops import run_in_thread
from asyncllm.async_engine.stream import RequestStream
from asyncllm.chat import (
    ChatTokenizer,
    Message,
    apply_chat_template,
    check_messages,
    check_template_kwargs,
    template_of,
)
from asyncllm.errors import InvalidRequestError, UnsupportedModelError
from asyncllm.input_limits import PromptBounds, check_nested
from asyncllm.outputs import RequestMetrics, StreamOutput, merge_metrics
from asyncllm.parsing import (
    ChatChunk,
    ChatStreamParser,
    ParserChoice,
    chat_stream_parser,
    choose_parsers,
    prompt_opens_reasoning,
)
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured import MAX_CONSTRAINT_CHARS

T = TypeVar("T")
Submit = Callable[[list[int], SamplingParams, str], RequestStream]


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A chat request that passed the cheap checks; `plan_chat` turns it into a `ChatPlan`."""

    tokenizer: ChatTokenizer
    messages: Sequence[Message]
    params: SamplingParams
    tools: ChatTools
    template: str
    template_kwargs: Mapping[str, Any]
    parsers: ParserChoice
    bounds: PromptBounds | None = None


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What a chat request sends the engine and how its replies are read. One plan serves any number of
    replies to the same conversation (the samples of one request): each gets `constrain(params)` and a
    fresh `parser()`."""

    prompt: str  # the templated conversation
    prompt_token_ids: list[int]
    grammar: str | None  # the tool calls' grammar, when the reply may call tools
    parsers: ParserChoice
    with_tools: bool  # the reply is parsed for tool calls

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the tool calls' grammar as its constraint, when tools are in play."""
        return params if self.grammar is None else dataclasses.replace(params, grammar=self.grammar)

    def parser(self) -> ChatStreamParser:
        """A fresh parser for one reply (parsers hold the state of the reply they read)."""
        return chat_stream_parser(self.parsers, self.prompt, with_tools=self.with_tools)


def check_chat(
    tokenizer: ChatTokenizer | None,
    messages: Sequence[Message],
    params: SamplingParams | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any],
    parallel_tool_calls: bool,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    architecture: str | None = None,
    bounds: PromptBounds | None = None,
) -> ChatRequest:
    """The cheap checks, in the caller's thread: `InvalidRequestError` naming the field, or
    `UnsupportedModelError` for a model without a template, or whose template shows no tool-call format
    asyncllm parses (nor its HF `architecture`, when known) while the request offers tools. `bounds`:
    the engine's (the messages' characters are bounded before templating, the prompt's tokens before their ids
    are made)."""
    check_messages(messages)
    # Bounded before the template or the tokenizer reads a character: size, nesting, valid Unicode.
    max_chars = bounds.max_chars if bounds is not None else None
    check_nested("messages", list(messages), max_chars=max_chars, over="no prompt the engine holds is that long")
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams or None, got {type(params).__name__}")
    if params.prompt_logprobs is not None:  # chat chunks carry the reply only: they would be computed and lost
        raise InvalidRequestError(
            "params.prompt_logprobs is not offered by chat: score a conversation with "
            "generate(engine.apply_chat_template(messages), params)"
        )
    checked = check_tools(tools, tool_choice, parallel_tool_calls)
    if checked.active:
        _check_params_with_tools(params)
    check_template_kwargs(chat_template_kwargs)
    check_nested("chat_template_kwargs", chat_template_kwargs, max_chars=max_chars)
    template = template_of(tokenizer, chat_template, with_tools=checked.offered)
    assert tokenizer is not None
    parsers = choose_parsers(template, architecture)
    if checked.active and parsers.tool_parser is None:
        raise UnsupportedModelError(
            "this chat template shows no tool-call format asyncllm can parse (Hermes/Qwen <tool_call>, Llama 3 "
            "JSON, Mistral [TOOL_CALLS]): call without tools, or pass a chat_template that offers them"
        )
    kwargs = dict(chat_template_kwargs or {})
    return ChatRequest(tokenizer, messages, params, checked, template, kwargs, parsers, bounds)


def _check_params_with_tools(params: SamplingParams) -> None:
    """The tools' grammar is the reply's constraint: what a constraint rules out is ruled out here, named."""
    if params.structured is not None:
        raise InvalidRequestError(
            f"params.{params.structured.field} and tools cannot be combined: the tools' grammar is the reply's "
            "constraint (call without tools, or with tool_choice='none', to constrain the reply yourself)"
        )
    for name, given in (("ignore_eos", params.ignore_eos), ("min_tokens", params.min_tokens)):
        if given:
            raise InvalidRequestError(
                f"params.{name} and tools cannot be combined: a reply constrained by the tools' grammar ends with "
                "EOS as soon as it is complete (use tool_choice='none', or no tools)"
            )


async def plan_chat(request: ChatRequest) -> ChatPlan:
    """`make_plan` in a worker thread (asyncio's or trio's): never on the loop."""
    return await _in_thread(lambda: make_plan(request))


def make_plan(request: ChatRequest) -> ChatPlan:
    """Template, encode, and build the grammar: blocking work, for a worker thread. A template's refusal,
    a tool schema that does not compile and a grammar too large raise `InvalidRequestError`."""
    from jinja2 import TemplateError  # transformers renders templates with jinja2

    tools = request.tools
    try:
        prompt = apply_chat_template(
            request.tokenizer,
            request.messages,
            tools=tools.tools if tools.offered else None,
            chat_template=request.template,
            template_kwargs=request.template_kwargs,
        )
    except TemplateError as e:  # the template's own checks (roles must alternate, ...) or a broken template
        raise InvalidRequestError(f"the chat template refused these messages: {e}") from e
    from asyncllm.core.detokenizer import backend_tokenizer

    # encode_batch, not encode: the Rust tokenizer's encode holds the GIL throughout (a long prompt stopped every
    # event loop for seconds, issue 39), its batch call lets go of it. Thread-safe: no state.
    encoding = backend_tokenizer(request.tokenizer).encode_batch([prompt], add_special_tokens=False)[0]
    bounds = request.bounds
    if bounds is not None and len(encoding) > bounds.max_tokens:  # refused before its ids become a list (GIL held)
        raise InvalidRequestError(
            f"messages: the templated conversation has {len(encoding):,} tokens, more than the {bounds.max_tokens:,} "
            "of the longest sequence this engine holds; shorten the conversation"
        )
    ids = encoding.ids
    grammar = _grammar(request, prompt) if tools.active else None
    return ChatPlan(prompt, ids, grammar, request.parsers, tools.active)


def _grammar(request: ChatRequest, prompt: str) -> str:
    from asyncllm.structured_output.tool_grammar import ReasoningStart, ToolGrammarSpec, tool_grammar

    tools, tags, fmt = request.tools, request.parsers.reasoning, request.parsers.tool_parser
    assert fmt is not None and tools.mode != "none"
    if tags is None:
        start = ReasoningStart.NONE
    else:
        start = ReasoningStart.OPEN if prompt_opens_reasoning(prompt, tags) else ReasoningStart.OPTIONAL
    think = (tags.start, tags.end) if tags is not None else ("<think>", "</think>")
    spec = ToolGrammarSpec(tools.schemas, fmt, tools.mode, tools.name, tools.parallel, start, think)
    text = tool_grammar(spec)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(
            f"tools: their call grammar has {len(text)} characters, over the {MAX_CONSTRAINT_CHARS} a request may "
            "carry: offer fewer tools or smaller parameter schemas"
        )
    return text


class ChatStream:
    """`async for chunk in engine.chat(...)` yields `ChatChunk`s, the last with a finish reason.

    The first `__anext__` templates the conversation off the loop (a template's refusal, a tool schema that
    does not compile, or a prompt too long raise `InvalidRequestError` there) and adds the request; chunks
    with nothing in them are skipped. Leaving early in any way (cancellation, `break`, `aclose()`, losing
    the last reference) aborts the request, as leaving a `RequestStream` does.

    With `SamplingParams.n` > 1 the n replies' chunks interleave, each labelled with its reply's `index`
    and read by a parser of its own; each reply ends with its own finish reason, and the stream ends once
    every reply has ended.
    """

    def __init__(self, request: ChatRequest, submit: Submit, request_id: str) -> None:
        self._request: ChatRequest | None = request
        self._submit = submit
        self._request_id = request_id
        self._stream: RequestStream | None = None
        self._parsers: list[ChatStreamParser] = []  # one per sample: a parser holds its reply's state
        self._sample_metrics: list[RequestMetrics | None] = []  # n > 1: each ended sample's own
        self._done = False
        self.metrics: RequestMetrics | None = None  # set with the final chunk (n > 1: the whole request's)

    @property
    def request_id(self) -> str:
        """The engine's id for the request (`engine.abort` takes it once the first chunk was asked for)."""
        return self._request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...] | None:
        return self._stream.prompt_token_ids if self._stream is not None else None

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> ChatChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._stream is None:
                await self._start()
            stream = self._stream
            assert stream is not None
            while True:
                out = await stream.__anext__()
                if out.finish_reason is not None:
                    self._sample_ended(stream, out)
                chunk = self._parsers[out.index].read(out.text, out.finish_reason)
                if not chunk.empty:
                    return chunk if out.index == 0 else dataclasses.replace(chunk, index=out.index)
        except BaseException:  # an error, or cancelled: the inner stream aborted itself if it was reading
            self.close()
            raise

    async def _start(self) -> None:
        request = self._request
        assert request is not None
        self._request = None  # the messages are not needed again
        plan = await plan_chat(request)
        if self._done:  # closed from another thread meanwhile
            raise StopAsyncIteration
        self._parsers = [plan.parser() for _ in range(request.params.n)]
        self._stream = self._submit(plan.prompt_token_ids, plan.constrain(request.params), self._request_id)

    def _sample_ended(self, stream: RequestStream, out: StreamOutput) -> None:
        if len(self._parsers) == 1:
            self._done, self.metrics = True, out.metrics
            return
        self._sample_metrics.append(out.metrics)
        if stream.finished:  # that was the last sample's final chunk
            self._done, self.metrics = True, merge_metrics(self._sample_metrics)

    def close(self) -> None:
        """Stop reading; abort the request unless it already ended. Idempotent."""
        self._done = True
        if self._stream is not None:
            self._stream.close()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # A `break` out of `async for` ends here; the inner stream would abort on its own, later.
        if getattr(self, "_done", True) is False:
            self.close()


async def _in_thread(fn: Callable[[], T]) -> T:
    box: list[T] = []
    await run_in_thread(lambda: box.append(fn()))
    return box[0]


def open_chat(
    tokenizer: ChatTokenizer | None,
    submit: Submit,
    messages: Sequence[Message],
    params: SamplingParams | None,
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any],
    parallel_tool_calls: bool,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    request_id: str | None,
    architecture: str | None = None,
    bounds: PromptBounds | None = None,
) -> ChatStream:
    """The stream of one chat request, checked now (see `check_chat`)."""
    request_id = new_request_id() if request_id is None else check_request_id(request_id)
    request = check_chat(
        tokenizer,
        messages,
        params,
        tools,
        tool_choice,
        parallel_tool_calls,
        chat_template,
        chat_template_kwargs,
        architecture,
        bounds,
    )
    return ChatStream(request, submit, request_id)
