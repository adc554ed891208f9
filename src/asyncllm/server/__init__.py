"""`asyncllm serve`: an OpenAI-compatible HTTP server over the public `AsyncLLMEngine` API.

Sits above the engine: uses only the public surface (engine, SamplingParams, outputs, errors) and never
imports torch. `create_app` (FastAPI, the `server` extra: docs/install.md) is resolved lazily so that the
command line can parse arguments without the extra installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncllm.server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from asyncllm.server.app import create_app

        return create_app
    raise AttributeError(f"module 'asyncllm.server' has no attribute {name!r}")
