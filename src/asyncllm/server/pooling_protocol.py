"""Request bodies of the embedding and scoring endpoints: OpenAI's /v1/embeddings, the Jina/Cohere shape of
/v1/rerank and vLLM's /v1/score, named and typed as they name them (plus vLLM's `truncate_prompt_tokens` and
`priority`, and the server's `timeout`). As `protocol.py`: an unknown field is refused naming it, every
optional field accepts null. Field bounds that need the engine (dimensions, input counts, lengths) are the
engine's checks (`async_engine/pooling_inputs.py`), answered as 400s naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Strict):
    model: str
    # A string, a list of strings, a list of token ids, or a list of those lists (OpenAI's four forms).
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"  # base64: little-endian float32, as OpenAI's
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last n tokens (-1: the engine's limit)
    priority: int | None = 0  # vLLM's: lower runs first
    timeout: float | None = None  # seconds, at most the server's request_timeout


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Strict):
    model: str | None = None  # None: the served model
    query: str
    documents: list[str | RerankDocument]  # strings, or Cohere's {"text": ...} objects
    top_n: int | None = None  # None: every document
    return_documents: bool | None = True
    instruction: str | None = None  # a yes/no reranker's task line (asyncllm's; None: its default)
    priority: int | None = 0
    timeout: float | None = None


class ScoreRequest(_Strict):
    model: str | None = None
    text_1: str  # the query
    text_2: str | list[str]  # one document or several: one score each
    instruction: str | None = None
    priority: int | None = 0
    timeout: float | None = None
