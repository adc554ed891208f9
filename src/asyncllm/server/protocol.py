"""Request bodies of the OpenAI endpoints, as pydantic models named and typed as OpenAI names them.

Owns field names, types and bounds only; what a field means for sampling lives in `openai_params`. An
unknown field is refused (400 naming it), as OpenAI does, rather than silently ignored. Responses are
plain dicts built in `responses` (cheaper per streamed chunk than models).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(_Strict):
    role: str
    # A string, or OpenAI's list of content parts (text parts only: checked in `prompts`).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _SamplingRequest(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted for compatibility: identifies the end user, changes nothing
    # Extras beyond OpenAI's set (vLLM's names; the openai client sends them through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # Structured output beyond response_format (vLLM's guided_* under their engine's own names).
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


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
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_SamplingRequest):
    # str, list[str], list[int] or list[list[int]]: checked in `prompts`, where the error can name it plainly.
    prompt: Any
    logprobs: int | None = None
    echo: bool = False  # only False is supported (checked in `prompts`)
