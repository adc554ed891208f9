"""A chat completion request through the same planning as `engine.chat`: messages, tools and template
variables checked (`check_chat`), then templated, encoded and given the tools' grammar off the loop
(`plan_chat`); every refusal is a 400 naming the request's field.

Owns only what differs over HTTP: OpenAI's names in errors, a constraint of the request's own
(`response_format`, `regex`, ...) refused beside tools that may be called, and the server's chat template.
Knows nothing of response shapes.
"""

from __future__ import annotations

import re

from asyncllm import AsyncLLMEngine, SamplingParams
from asyncllm.async_engine.chat_session import ChatPlan, check_chat, plan_chat
from asyncllm.async_engine.chat_tools import check_tools
from asyncllm.errors import InvalidRequestError, UnsupportedModelError
from asyncllm.server.errors import OpenAIError
from asyncllm.server.prompts import chat_messages
from asyncllm.server.protocol import ChatCompletionRequest

# The chat planning's errors open with the field at fault, in OpenAI's spelling ("tools[1].function.name
# must be ...", "tool_choice names the tool ...", "messages[0]['content'] ...").
_LEADING_FIELD = re.compile(
    r"(tools(?:\[\d+\](?:\.\w+)*)?|tool_choice|parallel_tool_calls|chat_template_kwargs|messages(?:\[\d+\])?)\b"
)
# A constraint of the request's own, by SamplingParams field -> the request's name for it.
_CONSTRAINT_FIELDS = {"json_schema": "response_format", "json_object": "response_format"}


async def plan_chat_request(
    engine: AsyncLLMEngine, body: ChatCompletionRequest, params: SamplingParams, chat_template: str | None
) -> ChatPlan:
    """The plan every sample of `body` shares (`params`: the request's, `n` samples of it)."""
    messages = chat_messages(body.messages)
    tool_choice = "auto" if body.tool_choice is None else body.tool_choice
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    try:
        tools = check_tools(body.tools, tool_choice, parallel)  # cheap (check_chat repeats it)
        if tools.active:
            _check_constraints_with_tools(params)
        request = check_chat(
            engine.tokenizer,
            messages,
            params,
            body.tools,
            tool_choice,
            parallel,
            chat_template,
            body.chat_template_kwargs,
            bounds=engine.prompt_bounds,
        )
    except UnsupportedModelError as exc:  # no template, or tools offered to a model with no known call format
        if tools.active:
            raise OpenAIError(
                "this model's chat template shows no tool-call format asyncllm can parse (Hermes/Qwen <tool_call>, "
                "Llama 3 JSON, Mistral [TOOL_CALLS]): send no tools (or tool_choice 'none'), or serve the model "
                "with a chat template that lists tools (asyncllm serve --chat-template)",
                param="tools",
            ) from None
        raise OpenAIError(f"{exc}; use /v1/completions with a prompt instead", param="messages") from None
    except InvalidRequestError as exc:
        raise _named(exc) from None
    try:
        return await plan_chat(request)
    except InvalidRequestError as exc:  # the template refused the messages, or a tool schema does not compile
        raise _named(exc) from None


def _check_constraints_with_tools(params: SamplingParams) -> None:
    """A reply that may call tools is constrained by the tools' grammar, which ends it with EOS once it is
    complete: a constraint of the request's own, `ignore_eos` or `min_tokens` cannot hold beside it (the
    chat planning refuses them too, in the Python API's words)."""
    clash = None
    if params.structured is not None:
        clash = _CONSTRAINT_FIELDS.get(params.structured.field, params.structured.field)
    elif params.ignore_eos or params.min_tokens:
        clash = "ignore_eos" if params.ignore_eos else "min_tokens"
    if clash is not None:
        raise OpenAIError(
            f"{clash} cannot be combined with tools the reply may call: the tools' grammar constrains that reply "
            "(send tool_choice='none', or no tools, to use it)",
            param=clash,
        )


def _named(exc: InvalidRequestError) -> OpenAIError:
    match = _LEADING_FIELD.match(str(exc))
    return OpenAIError(str(exc), param=match.group(1) if match is not None else "messages")
