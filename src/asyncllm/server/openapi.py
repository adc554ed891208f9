"""The OpenAPI schema (/openapi.json, and the /docs page built from it) with the two generation endpoints in
it: they are plain Starlette routes (`json_route`, for speed), which FastAPI's schema leaves out. Their request
bodies are described by the same pydantic models that validate them. Knows nothing of what the endpoints do.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def document_plain_routes(app: FastAPI, routes: list[tuple[str, type[BaseModel], str]]) -> None:
    """Make `app.openapi()` also describe each (POST path, body model, summary) of `routes`."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = default()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model, summary in routes:
            body = model.model_json_schema(ref_template=_REF)
            schemas.update(body.pop("$defs", {}))
            schemas[model.__name__] = body
            schema.setdefault("paths", {})[path] = {"post": _operation(path, model.__name__, summary)}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _operation(path: str, model_name: str, summary: str) -> dict[str, Any]:
    json_body = {"application/json": {"schema": {"$ref": _REF.format(model=model_name)}}}
    error = {"description": "an OpenAI-style error body naming what is wrong (400: the field)"}
    return {
        "summary": summary,
        "operationId": path.strip("/").replace("/", "_"),
        "requestBody": {"required": True, "content": json_body},
        "responses": {
            "200": {"description": "the completion: JSON, or server-sent events when `stream` is true"},
            "400": error,
            "404": error,
            "429": error,
            "503": error,
        },
    }
