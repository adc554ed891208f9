"""API-key check: every path but the health probes needs `Authorization: Bearer <key>` (or, as Anthropic's
clients send it, `x-api-key: <key>`) when the app has a key.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers and detaches streamed
responses from the client's disconnects). Keys are compared in constant time.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from asyncllm.server.errors import OpenAIError
from asyncllm.server.messages_api import error_response

OPEN_PATHS = frozenset({"/health", "/health/live"})  # load balancers and orchestrators probe without credentials


def _app_path(scope: Scope) -> str:
    """The path within this app: mounted under a prefix, Starlette keeps the full path in `path`."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _app_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        given = next((value for name, value in headers if name == b"authorization"), b"")
        keyed = next((value for name, value in headers if name == b"x-api-key"), None)
        # Both compared whatever the first gives: the time taken tells nothing of either key.
        bearer_ok = hmac.compare_digest(given, self._expected)
        key_ok = keyed is not None and hmac.compare_digest(keyed, self._key)
        if bearer_ok or key_ok:
            await self.app(scope, receive, send)
            return
        error = OpenAIError(
            "Incorrect or missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
            status=401,
            type="invalid_request_error",
            code="invalid_api_key",
        )
        anthropic = _app_path(scope).startswith("/v1/messages")  # Anthropic's clients read their own shape
        await (error_response(error) if anthropic else error.response())(scope, receive, send)
