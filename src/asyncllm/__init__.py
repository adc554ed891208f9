"""asyncllm: an asyncio-native LLM inference engine.

Importing the package never imports torch: the public surface resolves lazily, and the engine loads the
runner (torch) only when it is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncllm.errors import (
    AsyncLLMError,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineStalledError,
    GrammarCompileTimeoutError,
    InvalidRequestError,
    LoRAError,
    RequestFailedError,
    RequestTimeoutError,
    StreamInUseError,
    UnsupportedModelError,
)
from asyncllm.outputs import RequestMetrics, RequestOutput, StreamOutput
from asyncllm.parsing import ChatChunk, ToolCall, ToolCallDelta
from asyncllm.pooling import EmbeddingOutput, RerankResult
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncllm.async_engine.chat_session import ChatStream
    from asyncllm.async_engine.engine import AsyncLLMEngine
    from asyncllm.async_engine.stream import RequestStream
    from asyncllm.llm import LLM

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "AsyncLLMError",
    "ChatChunk",
    "ChatStream",
    "EmbeddingOutput",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineOverloadedError",
    "EngineStalledError",
    "GrammarCompileTimeoutError",
    "InvalidRequestError",
    "LoRAError",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "RequestTimeoutError",
    "RerankResult",
    "SamplingParams",
    "StreamInUseError",
    "StreamOutput",
    "ToolCall",
    "ToolCallDelta",
    "UnsupportedModelError",
]
__version__ = "0.1.0"  # the distribution's version too (pyproject.toml reads it from here)


def __getattr__(name: str) -> Any:
    if name == "AsyncLLMEngine":
        from asyncllm.async_engine.engine import AsyncLLMEngine

        return AsyncLLMEngine
    if name == "LLM":
        from asyncllm.llm import LLM

        return LLM
    if name == "ChatStream":
        from asyncllm.async_engine.chat_session import ChatStream

        return ChatStream
    if name == "RequestStream":
        from asyncllm.async_engine.stream import RequestStream

        return RequestStream
    raise AttributeError(f"module 'asyncllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazily resolved names too (`dir(asyncllm)`, tab completion)."""
    return sorted({*globals(), *__all__})
