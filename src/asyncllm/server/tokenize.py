"""vLLM's small utility endpoints: POST /tokenize (a prompt, or chat messages through the same planning as
a chat completion), POST /detokenize, and GET /version.

Owns their request and response shapes as vLLM writes them (`count`, `max_model_len`, `tokens`,
`token_strs`; `prompt`). Knows nothing of generation.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncllm import SamplingParams, __version__
from asyncllm.server.chat_request import plan_chat_request
from asyncllm.server.errors import OpenAIError
from asyncllm.server.protocol import ChatCompletionRequest, ChatMessage, _Strict
from asyncllm.server.state import ServerState, server_state


class TokenizeRequest(_Strict):
    """A text `prompt` (special tokens added as a completion's are), or chat `messages` templated as a chat
    completion's (with its `tools` and template variables)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # accepted when true (a chat prompt always ends with it)
    return_token_strs: bool | None = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


def _engine(state: ServerState, model: str | None) -> Any:
    return state.resolve(state.served_model_name if model is None else model)[0]


async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state = server_state(request)
    engine = _engine(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError("give prompt or messages (exactly one)", param="prompt")
    if engine.tokenizer is None:
        raise OpenAIError("this model has no tokenizer", param="prompt")
    if body.messages is not None:
        if body.add_generation_prompt is False or body.add_special_tokens:
            param = "add_generation_prompt" if body.add_generation_prompt is False else "add_special_tokens"
            raise OpenAIError(f"{param} is not supported with messages: the chat template decides", param=param)
        fields = {"messages": body.messages, "tools": body.tools, "chat_template_kwargs": body.chat_template_kwargs}
        chat = ChatCompletionRequest.model_validate({"model": state.served_model_name, **fields})
        plan = await plan_chat_request(engine, chat, SamplingParams(), state.chat_template)
        ids = list(plan.prompt_token_ids)
    else:
        if body.tools is not None or body.chat_template_kwargs is not None:
            raise OpenAIError("tools and chat_template_kwargs go with messages", param="tools")
        text, special = body.prompt, body.add_special_tokens is not False
        ids = await asyncio.to_thread(lambda: list(engine.tokenizer(text, add_special_tokens=special).input_ids))
    result: dict[str, Any] = {"count": len(ids), "max_model_len": engine.runtime.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(result)


async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = server_state(request)
    engine = _engine(state, body.model)
    if engine.tokenizer is None:
        raise OpenAIError("this model has no tokenizer", param="tokens")
    vocab = len(engine.tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(f"token id {bad} is not in the vocabulary [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(lambda: engine.tokenizer.decode(body.tokens))
    return JSONResponse({"prompt": text})


async def version(request: Request) -> Response:
    return JSONResponse({"version": __version__})
