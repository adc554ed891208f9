"""OpenAI-shaped errors: the exception handlers raise and the body every failure answers with.

Owns the mapping from each failure to a status and `{"error": {message, type, param, code}}`: the client's
(a bad field, an engine-side `InvalidRequestError`: 400), the engine's load (`EngineOverloadedError`: 429
with Retry-After), the engine's failure of one request or of its device (`RequestFailedError`,
`DeviceError`: 500 with the message), an engine that cannot serve (dead, stalled or draining: 503), and an
unexpected bug (a generic 500, logged here, never a traceback in a response). `engine_error` is the one
mapping, for handlers and for errors that arrive after a stream has started alike.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncllm.errors import (
    AsyncLLMError,
    DeviceError,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineStalledError,
    InvalidRequestError,
    RequestFailedError,
    RequestTimeoutError,
    UnsupportedModelError,
)
from asyncllm.validation import short_repr

logger = logging.getLogger("asyncllm.server")

# SamplingParams errors read "SamplingParams.<field>=<value> is invalid: ...": the field is the param.
# "...field=value is invalid", "...field is not", "...field['properties'] nests deeper".
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)[= \[]")
_PYDANTIC_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})
# Seconds a client told "overloaded" (429) should wait: about the time a step takes to start a few of the
# waiting requests; the openai client honours it (and retries twice by default).
RETRY_AFTER_S = 1


class OpenAIError(Exception):
    """An error the client should see, with OpenAI's status, type, param and code."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(
    exc: InvalidRequestError, param: str | None = None, renames: dict[str, str] | None = None
) -> OpenAIError:
    """400 for an engine-side `InvalidRequestError`; a SamplingParams field names itself (renamed to its
    OpenAI name, e.g. max_tokens -> max_completion_tokens, in the param and the text), else `param` is the
    request field at fault."""
    message = str(exc)
    match = _SAMPLING_FIELD.search(message)
    if match is not None:
        param = (renames or {}).get(match.group(1), match.group(1))
        message = message[: match.start()] + param + message[match.end(1) :]  # the request's own vocabulary
    return OpenAIError(message, param=param)


def engine_dead(exc: EngineDeadError) -> OpenAIError:
    """503: dead, stalled (a stuck step) or draining (shutting down gracefully): try another replica."""
    code = (
        "engine_draining"
        if isinstance(exc, EngineDrainingError)
        else "engine_stalled"
        if isinstance(exc, EngineStalledError)
        else "engine_dead"
    )
    return OpenAIError(f"the engine is not serving: {exc}", status=503, type="service_unavailable", code=code)


def engine_error(exc: AsyncLLMError) -> OpenAIError:
    """The response to an error the engine raised on purpose (see the module's docstring)."""
    if isinstance(exc, InvalidRequestError):
        return invalid_request(exc)
    if isinstance(exc, EngineDeadError):
        return engine_dead(exc)
    if isinstance(exc, EngineOverloadedError):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return OpenAIError(str(exc), status=429, type="rate_limit_error", code="engine_overloaded", headers=headers)
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(str(exc), status=408, type="timeout_error", code="request_timeout")
    if isinstance(exc, RequestFailedError):
        return OpenAIError(str(exc), status=500, type="server_error", code="request_failed")
    if isinstance(exc, DeviceError):
        return OpenAIError(f"the device failed: {exc}", status=500, type="server_error", code="device_error")
    if isinstance(exc, UnsupportedModelError):
        return OpenAIError(str(exc))
    logger.error("asyncllm server: unexpected engine error", exc_info=exc)
    return OpenAIError(f"the engine failed: {exc}", status=500, type="server_error")


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"; union member tags are dropped."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    if not parts or not isinstance(parts[0], str):
        return None
    param = parts[0]
    for part in parts[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _PYDANTIC_TYPE_TAGS:
            param += f".{part}"
        else:
            break
    return param


def validation_error(exc: RequestValidationError) -> OpenAIError:
    return body_error(exc.errors()[0])


def body_error(first: Mapping[str, Any]) -> OpenAIError:
    """400 for a request body's first validation error (pydantic's, its `loc` starting at "body")."""
    kind, loc = first.get("type", ""), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        return OpenAIError(f"the request body is not valid JSON: {first.get('msg', '')}")
    param = _param_from_loc(loc)
    if kind == "extra_forbidden":
        return OpenAIError(f"Unrecognized request argument supplied: {param}", param=param)
    if param is None:
        return OpenAIError(f"invalid request body: {first.get('msg', '')}")
    given = first.get("input")
    shown = "" if kind == "missing" else f" (got {short_repr(given, 100)})"
    return OpenAIError(f"{param}: {first.get('msg', 'invalid value')}{shown}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_openai(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).response()

    async def on_engine(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(
            exc, AsyncLLMError
        )  # from add_request, or from a stream (a SamplingParams field names itself)
        return engine_error(exc).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(str(exc.detail), status=exc.status_code, type=kind).response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("asyncllm server: unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return OpenAIError("internal server error", status=500, type="server_error").response()

    app.add_exception_handler(OpenAIError, on_openai)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(AsyncLLMError, on_engine)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
