"""API-key check: every path but the health probes needs `Authorization: Bearer <key>` when the app has a key.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers and detaches streamed
responses from the client's disconnects). Keys are compared in constant time.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from asyncllm.server.errors import OpenAIError

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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _app_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        error = OpenAIError(
            "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            status=401,
            type="invalid_request_error",
            code="invalid_api_key",
        )
        await error.response()(scope, receive, send)
