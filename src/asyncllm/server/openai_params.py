"""OpenAI request parameters -> one `SamplingParams` with `n` (the samples run as one engine request), with
errors naming the OpenAI field.

Owns the mapping of names (max_completion_tokens, top_logprobs, ...) and of OpenAI's defaults and bounds
onto the engine's (completions stop after 16 tokens unless told otherwise, temperature is at most 2).
`SamplingParams` validates the values; its `InvalidRequestError` is turned into a 400 that names the field
as the request does. Knows nothing of HTTP beyond `OpenAIError`.
"""

from __future__ import annotations

from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.input_limits import check_logit_bias
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.errors import OpenAIError, invalid_request
from asyncllm.server.neutral_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_neutral
from asyncllm.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingRequest

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is "until the model stops")
MAX_TEMPERATURE = 2.0  # OpenAI's bound: beyond it sampling is close to uniform noise

# Request fields passed to SamplingParams under the same name when given (None keeps the engine default,
# which for temperature and top_p is OpenAI's default, 1.0).
_SAME_NAME = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "regex",
    "choice",
    "grammar",
    "stop_token_ids",
    "include_stop_str_in_output",
)
# vLLM's `structured_outputs.<name>` -> the SamplingParams field it sets.
_STRUCTURED_OUTPUTS = {"json_": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_STRUCTURED_RENAMES = {
    "json_schema": "structured_outputs.json",
    "json_object": "structured_outputs.json_object",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
}


def chat_sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    """One `SamplingParams` with `n`: the samples run as one engine request (the conversation prefilled once)."""
    check_neutral(request, CHAT_FIELDS)
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise OpenAIError("give max_completion_tokens or max_tokens, not both", param="max_completion_tokens")
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    renames = chat_renames(request)
    constraint = _response_format(request)
    if request.structured_outputs is not None:
        if constraint:
            raise OpenAIError("give response_format or structured_outputs, not both", param="structured_outputs")
        constraint = _structured_outputs(request)
    return _with_n(request, max_tokens, logprobs, renames, constraint, prompt_logprobs=request.prompt_logprobs)


def chat_renames(request: ChatCompletionRequest) -> dict[str, str]:
    """SamplingParams field -> the chat request's name for it, for errors."""
    max_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    renames = {"max_tokens": max_field, "logprobs": "top_logprobs"}
    if request.structured_outputs is not None:
        return renames | _STRUCTURED_RENAMES
    return renames | {"json_schema": "response_format", "json_object": "response_format"}


def completion_sampling_params(request: CompletionRequest) -> SamplingParams:
    """One `SamplingParams` with `n`: the samples run as one engine request (the prompt prefilled once)."""
    check_neutral(request, COMPLETION_FIELDS)
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise OpenAIError(
            f"best_of={request.best_of} is not supported: only best_of equal to n (every sample is returned)",
            param="best_of",
        )
    max_tokens = COMPLETION_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    logprobs, prompt_logprobs = request.logprobs, request.prompt_logprobs
    renames: dict[str, str] = {}
    if max_tokens == 0 and not request.echo:
        raise OpenAIError(
            "max_tokens=0 is invalid: at least 1, or 0 with echo=true (the prompt alone)", param="max_tokens"
        )
    # With echo, the prompt's logprobs too, before the completion's (`echo.py`); each reader takes its top k.
    echoed = request.logprobs if request.echo else None
    if echoed is not None and (prompt_logprobs is None or prompt_logprobs < echoed):
        prompt_logprobs, renames = request.logprobs, {"prompt_logprobs": "logprobs"}
    if echoes_prompt_only(request):  # one token is drawn and left out: the engine ends after a draw
        if request.min_tokens:
            raise OpenAIError(f"min_tokens={request.min_tokens} is invalid: at most max_tokens (0)", param="min_tokens")
        max_tokens, logprobs = 1, None
    constraint = _structured_outputs(request) if request.structured_outputs is not None else None
    renames |= completion_renames(request)
    return _with_n(request, max_tokens, logprobs, renames, constraint, prompt_logprobs=prompt_logprobs)


def completion_renames(request: CompletionRequest) -> dict[str, str]:
    """SamplingParams field -> the completion request's name for it, for errors the engine raises later (a
    constraint that does not compile)."""
    return _STRUCTURED_RENAMES if request.structured_outputs is not None else {}


def echoes_prompt_only(request: CompletionRequest) -> bool:
    """`echo` with `max_tokens=0`: the response is the prompt (scored, with `logprobs`), as OpenAI allowed."""
    return bool(request.echo) and request.max_tokens == 0


def _response_format(request: ChatCompletionRequest) -> dict[str, Any]:
    """`response_format` as SamplingParams fields: text is no constraint, json_object any JSON object,
    json_schema its schema."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise OpenAIError("response_format of type json_schema needs json_schema.schema", param="response_format")
    return {"json_schema": fmt.json_schema.schema_}


def _structured_outputs(request: _SamplingRequest) -> dict[str, Any]:
    """vLLM's `structured_outputs` as SamplingParams fields; beside the same constraint given at the top level
    (`regex`, `choice`, `grammar`: vLLM's older spelling) it is a 400."""
    given = request.structured_outputs
    assert given is not None
    fields = {field: getattr(given, name) for name, field in _STRUCTURED_OUTPUTS.items()}
    fields = {field: value for field, value in fields.items() if value is not None}
    if given.json_object:
        fields["json_object"] = True
    clash = next((name for name in ("regex", "choice", "grammar") if getattr(request, name) is not None), None)
    if clash is not None and fields:
        raise OpenAIError(f"give {clash} or structured_outputs, not both", param="structured_outputs")
    return fields


def _with_n(
    request: _SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    renames: dict[str, str],
    constraint: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """`n` samples of one prompt; with a seed, the engine gives sample i seed + i: they differ and each is
    reproducible (choice j equals a request of its own seeded seed + j)."""
    if request.stream_options is not None and not request.stream:
        raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")
    if request.prompt_logprobs is not None and request.stream:  # vLLM's rule too: they come whole, once
        raise OpenAIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if request.temperature is not None and not 0.0 <= request.temperature <= MAX_TEMPERATURE:
        raise OpenAIError(
            f"temperature={request.temperature} is invalid: a number in [0, {MAX_TEMPERATURE:g}]", param="temperature"
        )
    kwargs: dict[str, Any] = {name: getattr(request, name) for name in _SAME_NAME if getattr(request, name) is not None}
    kwargs.update(max_tokens=max_tokens, stop=request.stop, logprobs=logprobs, **(constraint or {}))
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    if request.logit_bias:
        try:
            kwargs["logit_bias"] = check_logit_bias("logit_bias", request.logit_bias)
        except InvalidRequestError as exc:
            raise OpenAIError(str(exc), param="logit_bias") from None
    try:
        return SamplingParams(**kwargs, n=request.n or 1, seed=request.seed)
    except InvalidRequestError as exc:
        raise invalid_request(exc, renames=renames) from None
