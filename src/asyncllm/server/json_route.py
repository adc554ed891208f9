"""The two generation endpoints as plain Starlette routes: the JSON body read and validated into its pydantic
model exactly as FastAPI would (the same content types, the same errors, hence the same 400 bodies naming
the field), without FastAPI's per-request dependency solving, which cost as much as the endpoint's own work
(bench/RESULTS.md, serve_path). Knows nothing of what the endpoints do.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm.server.errors import OpenAIError, body_error
from asyncllm.server.json_body import body_byte_limit, parse_json_body, read_body_bytes
from asyncllm.server.streaming import disconnected_response

Body = TypeVar("Body", bound=BaseModel)

# FastAPI's answer to a body it could not even decode (bytes that are not UTF-8 under a JSON content type).
_UNREADABLE = "There was an error parsing the body"


def json_route(path: str, model: type[Body], handler: Callable[[Body, Request], Awaitable[Response]]) -> Route:
    """POST `path`: `handler(model instance, request)`. A body that is not a valid `model` raises OpenAIError
    (400), with the message and param FastAPI's validation would have led to (`errors.body_error`)."""

    async def endpoint(request: Request) -> Response:
        try:
            raw = await read_body_bytes(request, body_limit(request))
        except ClientDisconnect:  # gone before its body arrived: nothing to answer, nothing to log
            return disconnected_response()
        return await handler(await read_body(model, raw, request.headers.get("content-type")), request)

    return Route(path, endpoint, methods=["POST"], include_in_schema=False)


async def read_body(model: type[Body], raw: bytes, content_type: str | None) -> Body:
    """`raw` as FastAPI reads a body parameter: JSON only under a JSON content type (strict: none given is not
    JSON), an empty body missing; then validated as FastAPI validates (python mode, from attributes). JSON
    nested too deep or holding a lone surrogate is refused first, naming the field (`json_body`)."""
    data: Any = None
    error: Mapping[str, Any] | None = None
    if not raw:
        error = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
    elif _is_json(content_type):
        try:
            data = await parse_json_body(raw)
        except json.JSONDecodeError as exc:
            error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        except ValueError:  # undecodable bytes (UnicodeDecodeError)
            raise OpenAIError(_UNREADABLE) from None
    else:
        data = raw  # validated as bytes: "a valid dictionary or object" is what the client reads
    if error is None:
        try:
            return model.model_validate(data, from_attributes=True)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            error = {**first, "loc": ("body", *first["loc"])}
    raise body_error(error)


def body_limit(request: Request) -> int | None:
    """`json_body.body_byte_limit` of the app's engine (None: an app without one, or not loaded yet)."""
    state = getattr(request.app.state, "asyncllm", None)
    engine = getattr(state, "engine", None)
    return body_byte_limit(engine.prompt_bounds if engine is not None else None)


def _is_json(content_type: str | None) -> bool:
    """application/json or application/*+json, parameters aside, as `email.message` reads a content type."""
    if not content_type:
        return False
    mime = content_type.partition(";")[0].strip().lower()
    if mime.count("/") != 1:
        return False
    main, _, sub = mime.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))
