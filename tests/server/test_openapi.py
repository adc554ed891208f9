"""/openapi.json (and the /docs page built from it) describes every endpoint, the two generation endpoints
included (plain routes, which FastAPI's own schema leaves out), with request bodies whose references resolve."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server.serving import RunningServer


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [ref for key, value in node.items() for ref in ([value] if key == "$ref" else _refs(value))]
    if isinstance(node, list):
        return [ref for item in node for ref in _refs(item)]
    return []


def test_openapi_lists_the_generation_endpoints_with_their_bodies(server: RunningServer) -> None:
    r = httpx.get(f"{server.url}/openapi.json")
    assert r.status_code == 200
    schema = r.json()
    paths = schema["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health"):
        assert path in paths, path
    schemas = schema["components"]["schemas"]
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"messages", "model", "response_format", "tools"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"prompt", "model"} <= set(schemas["CompletionRequest"]["properties"])
    missing = {ref for ref in _refs(schema) if ref.removeprefix("#/components/schemas/") not in schemas}
    assert not missing
    assert httpx.get(f"{server.url}/docs").status_code == 200
