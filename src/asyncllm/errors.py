"""Typed errors at the API boundary.

Every error a caller can act on is one of these; internal invariants use `assert`.
This module imports nothing heavy so every layer may raise these.
"""

from __future__ import annotations


class AsyncLLMError(Exception):
    """Base class of every asyncllm error."""


class InvalidRequestError(AsyncLLMError, ValueError):
    """A bad prompt or bad sampling values. The engine and every other request carry on."""


class EngineDeadError(AsyncLLMError, RuntimeError):
    """The step loop failed (cause chained) or the engine was shut down; no request can be served."""


class UnsupportedModelError(AsyncLLMError, ValueError):
    """The checkpoint uses an architecture, quantization or feature asyncllm does not support."""
