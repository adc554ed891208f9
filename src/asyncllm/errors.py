"""Typed errors at the API boundary: every error asyncllm raises on purpose derives from `AsyncLLMError`.

Each also derives from the built-in a caller would expect (`ValueError` for bad values, `TypeError` for an
unknown argument, ...), so `except ValueError` keeps working, while a server maps one base class to its
status codes. Internal invariants use `assert`. Imports nothing, so every layer may raise these.
"""

from __future__ import annotations


class AsyncLLMError(Exception):
    """Base class of every error asyncllm raises on purpose."""


class InvalidRequestError(AsyncLLMError, ValueError):
    """A bad prompt or bad sampling values. The engine and every other request carry on."""


class GrammarCompileTimeoutError(InvalidRequestError):
    """The request's output constraint did not compile within the engine's `grammar_compile_timeout`: the
    request ended before it reached the core, and its compile was dropped. A simpler constraint compiles
    faster; every other request carried on (compiles run beside each other, never in front of requests that
    need none)."""


class LoRAError(InvalidRequestError):
    """A LoRA adapter that cannot be added, removed or used: a bad or unsupported adapter, a name taken or
    unknown, one still in use, or an engine without `enable_lora`. Nothing changed; the engine carries on."""


class InvalidConfigError(AsyncLLMError, ValueError):
    """A bad engine argument (the message names it, its value and the fix); nothing was started."""


class UnknownArgumentError(AsyncLLMError, TypeError):
    """An engine argument name asyncllm does not know."""


class ModelNotFoundError(AsyncLLMError, FileNotFoundError):
    """The model (or tokenizer) path names nothing asyncllm can load. No network access is attempted."""


class UnsupportedModelError(AsyncLLMError, ValueError):
    """The checkpoint uses an architecture, quantization or feature asyncllm does not support."""


class DeviceError(AsyncLLMError, RuntimeError):
    """The device cannot serve the configuration: no CUDA device, or no memory left for the KV cache."""


class EngineDeadError(AsyncLLMError, RuntimeError):
    """The step loop failed (cause chained) or the engine was shut down; no request can be served."""


class EngineDrainingError(EngineDeadError):
    """The engine is draining (`drain()`, or a server's SIGTERM): requests already in finish, new ones are
    refused. Not a failure: go to another replica."""


class EngineOverloadedError(AsyncLLMError, RuntimeError):
    """`add_request` at once, when `max_waiting_requests` requests already wait to start: retry later (the
    server answers 429 with Retry-After). Nothing of the refused request was kept."""


class RequestFailedError(AsyncLLMError, RuntimeError):
    """The engine failed this one request (an internal error, named in the message): not the caller's
    fault, and not the engine's death: every other request carries on."""


class RequestTimeoutError(AsyncLLMError, TimeoutError):
    """The request's `timeout` passed before it gave any output (waiting to start, or still computing its
    prompt): it ended, its blocks freed. One that timed out after some output ends with finish_reason
    "timeout" instead."""


class EngineStalledError(EngineDeadError):
    """`check_health`: the step in flight has run past the bound (a stuck device or kernel). The engine
    is not serving, though it may recover if the step ever returns."""


class StreamInUseError(AsyncLLMError, RuntimeError):
    """A second task tried to read a stream another task is reading: one reader per stream."""
