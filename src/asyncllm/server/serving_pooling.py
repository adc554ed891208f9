"""POST /v1/embeddings (OpenAI's shape), /v1/rerank (Jina's and Cohere's) and /v1/score (vLLM's), over
`engine.embed`, `engine.rerank` and `engine.score`.

Owns the answers' shapes: embeddings as floats or base64 (little-endian float32 bytes, what OpenAI's client
decodes: it asks for base64 unless told otherwise), `usage` from the engine's token counts, rerank results
best first with their documents unless `return_documents` is false, scores by input index. The engine's
checks name the field at fault (400); a generation endpoint on an embed engine, or one of these on a generate
engine, is refused by the engine (400 naming what the engine serves). A client that leaves aborts its
call's requests. Each call is counted (`pooling_metrics.py`).
"""

from __future__ import annotations

import array
import base64
import re
import secrets
import sys
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncllm import AsyncLLMEngine
from asyncllm.async_engine.pooling_api import scores_and_tokens
from asyncllm.async_engine.pooling_inputs import check_top_n, rerank_results
from asyncllm.errors import AsyncLLMError, EngineOverloadedError, InvalidRequestError, RequestTimeoutError
from asyncllm.server.errors import OpenAIError, invalid_request
from asyncllm.server.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from asyncllm.server.state import ServerState, server_state
from asyncllm.server.streaming import ClientDisconnected, cancel_on_disconnect, disconnected_response

T = TypeVar("T")
MAX_INPUTS = 2048  # inputs of one embeddings call, documents of one rerank or score: OpenAI's embeddings bound
# What an engine message opens with -> the request field it names ("dimensions=0 is invalid", "input 3 has").
_FIELD = re.compile(r"^(input|inputs|dimensions|truncate_prompt_tokens|query|documents|top_n|instruction|priority)\b")
_RENAMED = {"inputs": "input"}


async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    start = time.perf_counter()
    state = server_state(request)
    engine = _engine(state, body.model)
    _check_count("input", body.input)
    call = engine.embed(
        body.input,
        dimensions=body.dimensions,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        priority=body.priority or 0,
        timeout=state.timeout_for(body.timeout),
    )
    outputs = await _answer(state, request, "embeddings", call, start)
    if isinstance(outputs, Response):
        return outputs
    as_base64 = body.encoding_format == "base64"
    data = [
        {"object": "embedding", "index": i, "embedding": _base64(o.embedding) if as_base64 else o.embedding}
        for i, o in enumerate(outputs)
    ]
    tokens = sum(o.num_prompt_tokens for o in outputs)
    state.metrics.pooling.record("embeddings", "ok", time.perf_counter() - start, len(outputs), tokens)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({**_head("embd", body.model), "object": "list", "data": data, "usage": usage})


async def create_rerank(body: RerankRequest, request: Request) -> Response:
    start = time.perf_counter()
    state = server_state(request)
    model = body.model or state.served_model_name
    engine = _engine(state, model)
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    _check_count("documents", documents)
    try:
        top_n = check_top_n(body.top_n)
    except InvalidRequestError as exc:
        raise invalid_request(exc, param="top_n") from None
    call = scores_and_tokens(
        engine,
        body.query,
        documents,
        instruction=body.instruction,
        priority=body.priority or 0,
        timeout=state.timeout_for(body.timeout),
    )
    answer = await _answer(state, request, "rerank", call, start)
    if isinstance(answer, Response):
        return answer
    scores, tokens = answer
    results = []
    for r in rerank_results(scores, documents, top_n):
        result: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if body.return_documents is not False:
            result["document"] = {"text": r.document}
        results.append(result)
    state.metrics.pooling.record("rerank", "ok", time.perf_counter() - start, len(documents), tokens)
    return JSONResponse({**_head("rerank", model), "results": results, "usage": {"total_tokens": tokens}})


async def create_score(body: ScoreRequest, request: Request) -> Response:
    start = time.perf_counter()
    state = server_state(request)
    model = body.model or state.served_model_name
    engine = _engine(state, model)
    documents = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    _check_count("text_2", documents)
    call = scores_and_tokens(
        engine,
        body.text_1,
        documents,
        instruction=body.instruction,
        priority=body.priority or 0,
        timeout=state.timeout_for(body.timeout),
    )
    renames = {"query": "text_1", "documents": "text_2"}
    answer = await _answer(state, request, "score", call, start, renames)
    if isinstance(answer, Response):
        return answer
    scores, tokens = answer
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    state.metrics.pooling.record("score", "ok", time.perf_counter() - start, len(documents), tokens)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({**_head("score", model), "object": "list", "data": data, "usage": usage})


def _check_count(field: str, items: object) -> None:
    """A call's inputs are live requests at once: at most `MAX_INPUTS` (a larger batch goes in parts)."""
    if isinstance(items, list) and len(items) > MAX_INPUTS and not all(isinstance(x, int) for x in items):
        raise OpenAIError(f"{field} has {len(items)} items, more than {MAX_INPUTS}: send them in parts", param=field)


def _engine(state: ServerState, model: str) -> AsyncLLMEngine:
    engine, lora = state.resolve(model)  # 404 for a model this server does not serve
    if lora is not None:
        raise OpenAIError(f"`{model}` is a LoRA adapter: embeddings and scores come from the base model", param="model")
    return engine


async def _answer(
    state: ServerState,
    request: Request,
    endpoint: str,
    call: Coroutine[Any, Any, T],
    start: float,
    renames: dict[str, str] | None = None,
) -> T | Response:
    """The call's result; a client that left gets a 499 (its requests aborted); an engine error is counted
    and raised for the app's handlers (an InvalidRequestError as a 400 naming its field)."""
    try:
        return await cancel_on_disconnect(request, call)
    except ClientDisconnected:
        state.metrics.pooling.record(endpoint, "abort", time.perf_counter() - start)
        return disconnected_response()
    except InvalidRequestError as exc:
        state.metrics.pooling.record(endpoint, "invalid", time.perf_counter() - start)
        match = _FIELD.match(str(exc))
        param = None if match is None else {**_RENAMED, **(renames or {})}.get(match.group(1), match.group(1))
        raise invalid_request(exc, param=param) from None
    except AsyncLLMError as exc:
        outcome = (
            "overloaded"
            if isinstance(exc, EngineOverloadedError)
            else "timeout"
            if isinstance(exc, RequestTimeoutError)
            else "error"
        )
        state.metrics.pooling.record(endpoint, outcome, time.perf_counter() - start)
        raise


def _base64(vector: list[float]) -> str:
    """Little-endian float32 bytes, base64 (what OpenAI's client decodes for encoding_format="base64")."""
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def _head(prefix: str, model: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{secrets.token_hex(16)}", "created": int(time.time()), "model": model}
