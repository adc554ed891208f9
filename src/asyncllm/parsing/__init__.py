"""Reading a chat reply as it streams: reasoning split from the answer, tool calls parsed out of the answer.

Torch-free and engine-free: parsers take decoded text pieces and give back `ChatChunk`s; the async layer
feeds them and the server writes OpenAI's deltas from them. Modules: `types` (what comes out),
`reasoning` (`<think>` blocks), `tool_parser` (the base and shared rules) with one module per format
(`hermes`, `llama3_json`, `mistral`), `registry` (formats by name, the choice for a model), `chat_stream`
(the two combined), `scan` (tag and JSON-span scanning).
"""

from asyncllm.parsing.chat_stream import ChatStreamParser, chat_stream_parser
from asyncllm.parsing.reasoning import ReasoningDelta, ReasoningParser, ReasoningTags, prompt_opens_reasoning
from asyncllm.parsing.registry import TOOL_PARSERS, ParserChoice, choose_parsers, make_tool_parser
from asyncllm.parsing.tool_parser import ToolParse, ToolParser
from asyncllm.parsing.types import (
    ChatChunk,
    ChatFinishReason,
    ToolCall,
    ToolCallDelta,
    encode_arguments,
    merge_tool_call_deltas,
    new_call_id,
)

__all__ = [
    "TOOL_PARSERS",
    "ChatChunk",
    "ChatFinishReason",
    "ChatStreamParser",
    "ParserChoice",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningTags",
    "ToolCall",
    "ToolCallDelta",
    "ToolParse",
    "ToolParser",
    "chat_stream_parser",
    "choose_parsers",
    "encode_arguments",
    "make_tool_parser",
    "merge_tool_call_deltas",
    "new_call_id",
    "prompt_opens_reasoning",
]
