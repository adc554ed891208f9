"""Request bodies of the OpenAI endpoints, as pydantic models named and typed as OpenAI names them.

Owns field names, types and bounds only; what a field means for sampling lives in `openai_params`, which
fields are accepted only with a value that changes nothing in `neutral_fields`. Every optional field
accepts null (clients and frameworks send `"field": null` for "not set"). An unknown field is refused (400
naming it), as OpenAI does, rather than silently ignored. Responses are plain dicts built in `responses`
(cheaper per streamed chunk than models).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's side-channel padding: nothing to pad here, accepted
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: at most one constraint (`json` is a JSON schema, a dict or its text)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    parsed_arguments: Any = None  # the openai client's `parse()` adds it when a reply is sent back: ignored


class MessageToolCall(_Strict):
    """A call a past assistant turn made (OpenAI's `tool_calls[]` item)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    """One message of any role; which fields a role may carry is checked in `prompts`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or OpenAI's list of content parts (text parts only: checked in `prompts`).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # A past assistant turn's reasoning: DeepSeek's and vLLM's (older) name, and vLLM's newer one.
    reasoning_content: str | None = None
    reasoning: str | None = None
    # What OpenAI's own replies carry, sent back as history: accepted when null (checked in `prompts`).
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: list[Any] | None = None  # citations about the content: change nothing
    parsed: Any = None  # the openai client's `parse()` of the content, sent back with it: ignored


class _SamplingRequest(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # identifies the end user: changes nothing here
    logit_bias: dict[str, float] | None = None  # {token id: bias in [-100, 100]}, added to the logits
    # Extras beyond OpenAI's set (vLLM's names; the openai client sends them through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    priority: int | None = None  # lower runs first, FIFO within a priority (vLLM's extra; default 0)
    timeout: float | None = None  # seconds until the request ends (asyncllm's extra; --request-timeout: the default)
    # Structured output beyond response_format (vLLM's guided_* under their engine's own names).
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's newer spelling of the same constraints
    # More of vLLM's extras: stop ids, the prompt's logprobs, token ids in the response, prompt truncation.
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as fit)


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: `schema` is the JSON schema (`strict` is accepted: every
    constrained output satisfies its schema whatever its value)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Tools: OpenAI function tools and tool choice, checked by the chat planning (`engine.chat`'s).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # an extra (vLLM's): more template variables
    # OpenAI's fields that change nothing here when null or neutral; others are refused naming the field
    # (the values each accepts are listed in `neutral_fields`).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: dict[str, Any] | None = None
    web_search_options: Any = None
    moderation: Any = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    functions: list[Any] | None = None  # deprecated in favour of tools
    function_call: Any = None  # deprecated in favour of tool_choice


class CompletionRequest(_SamplingRequest):
    # str, list[str], list[int] or list[list[int]]: checked in `prompts`, where the error can name it plainly.
    prompt: Any
    logprobs: int | None = None
    echo: bool | None = False  # the prompt (and with `logprobs` its logprobs) before the completion: `echo.py`
    suffix: str | None = None  # null or "" only
    best_of: int | None = None  # null, or n (the n best of n are all n)
