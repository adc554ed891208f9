"""`create_app(engine_or_model, ...)`: the OpenAI-compatible FastAPI app, for `asyncllm serve` or embedding.

Owns routing, the lifespan (given a model path, the app builds its engine at startup and closes it at
shutdown; given an engine, it serves that one and leaves its lifetime to the caller) and the small
endpoints (/v1/models, /health and /health/live, /metrics). Generation lives in `serving_chat` and
`serving_completion`, embeddings and scores in `serving_pooling`; draining on SIGTERM in `drain`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncllm import AsyncLLMEngine
from asyncllm.errors import EngineDeadError, EngineDrainingError
from asyncllm.server.auth import APIKeyMiddleware
from asyncllm.server.body_deadline import BodyReadDeadline
from asyncllm.server.connections import DEFAULT_READ_TIMEOUT_S
from asyncllm.server.errors import OpenAIError, engine_dead, install_error_handlers
from asyncllm.server.json_route import json_route
from asyncllm.server.messages_api import MessagesRequest
from asyncllm.server.metrics import ServerMetrics
from asyncllm.server.openapi import document_plain_routes
from asyncllm.server.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from asyncllm.server.protocol import ChatCompletionRequest, CompletionRequest
from asyncllm.server.responses_api import ResponsesRequest
from asyncllm.server.serving_chat import create_chat_completion
from asyncllm.server.serving_completion import create_completion
from asyncllm.server.serving_messages import messages_route
from asyncllm.server.serving_pooling import create_embedding, create_rerank, create_score
from asyncllm.server.serving_responses import create_response
from asyncllm.server.state import ServerState, server_state
from asyncllm.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, version


def default_served_name(model: str | os.PathLike[str]) -> str:
    """A checkpoint directory's name, or a .gguf file's name without the suffix."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def create_app(
    engine_or_model: AsyncLLMEngine | str | os.PathLike[str],
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    engine_args: dict[str, Any] | None = None,
    chat_template: str | None = None,
    lora_modules: dict[str, str] | None = None,
    request_timeout: float | None = None,
    body_read_timeout: float | None = DEFAULT_READ_TIMEOUT_S,
) -> FastAPI:
    """The app serving one model under `served_model_name` (default: the checkpoint's name), and each of
    its LoRA adapters under the adapter's name (`engine.list_loras()`, as they are added and removed).

    `engine_or_model`: a running `AsyncLLMEngine` (mount the app anywhere; closing the engine stays
    yours), or a checkpoint path, built with `engine_args` in the app's lifespan and closed with it.
    `api_key`: when set, every endpoint but the health probes needs `Authorization: Bearer <api_key>`.
    `chat_template`: Jinja text that replaces the model's own chat template (one that lists tools, say).
    `lora_modules`: {name: adapter directory} added to the engine the lifespan builds (give a model path
    and `enable_lora=True` in `engine_args`); with an engine, add them with `engine.add_lora` yourself.
    `request_timeout`: seconds a request may run, its default when it asks for no `timeout` (None: none).
    `body_read_timeout`: seconds a request's body may take to arrive after its headers, else a 408 and the
    connection closed (`body_deadline.py`; None: no bound, for a server that bounds reads itself). Bounding
    the headers' time and the connections is the server's (docs/server.md: Connections).
    """
    if isinstance(engine_or_model, (str, os.PathLike)):
        model: str | None = os.fspath(engine_or_model)
        given: AsyncLLMEngine | None = None
        name = served_model_name or default_served_name(engine_or_model)
    else:
        model, given = None, engine_or_model
        config = getattr(given, "config", None)  # None for engines built by AsyncLLMEngine.from_builder
        name = served_model_name or (default_served_name(config.model) if config is not None else "asyncllm")
    if (engine_args or lora_modules) and given is not None:
        raise TypeError("engine_args and lora_modules apply to a model path only: this engine is already built")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise ValueError(f"chat_template must be non-empty Jinja text, got {chat_template!r}")
    if request_timeout is not None and not 0 < request_timeout < float("inf"):
        raise ValueError(f"request_timeout must be seconds > 0, got {request_timeout!r}")
    if body_read_timeout is not None and not 0 < body_read_timeout < float("inf"):
        raise ValueError(f"body_read_timeout must be seconds > 0, got {body_read_timeout!r}")
    counters = ServerMetrics(lambda: state.stats(), name)
    state = ServerState(name, counters, chat_template=chat_template, request_timeout=request_timeout)
    if given is not None:
        state.attach(given)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if model is None:
            yield
            return
        # Loading takes seconds to minutes: off the event loop (the engine is bound to no loop).
        engine = await asyncio.to_thread(lambda: AsyncLLMEngine(model, **(engine_args or {})))
        try:
            for adapter, path in (lora_modules or {}).items():
                await engine.add_lora(adapter, path)
            state.attach(engine)
            yield
        finally:
            await engine.aclose()

    app = FastAPI(title="asyncllm", summary="OpenAI-compatible API", lifespan=lifespan)
    app.state.asyncllm = state
    app.state.created = int(time.time())
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if body_read_timeout is not None:  # added last: outermost, so it bounds every route's body
        app.add_middleware(BodyReadDeadline, seconds=body_read_timeout)
    # Plain routes (json_route: FastAPI's per-request dependency machinery cost as much as the endpoint), first:
    # the router tries routes in order, and these two no longer wait behind /docs, /openapi.json and the rest.
    app.router.routes[:0] = [
        json_route("/v1/chat/completions", ChatCompletionRequest, create_chat_completion),
        json_route("/v1/completions", CompletionRequest, create_completion),
        json_route("/v1/responses", ResponsesRequest, create_response),  # OpenAI's Responses API
        messages_route("/v1/messages"),  # Anthropic's Messages API, errors in its shape
        json_route("/tokenize", TokenizeRequest, tokenize),
        json_route("/detokenize", DetokenizeRequest, detokenize),
        # Embed and score engines (serving_pooling.py), under vLLM's paths too
        json_route("/v1/embeddings", EmbeddingRequest, create_embedding),
        *(json_route(path, RerankRequest, create_rerank) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
        *(json_route(path, ScoreRequest, create_score) for path in ("/v1/score", "/score")),
    ]
    document_plain_routes(  # FastAPI's schema (/docs) leaves plain routes out
        app,
        [
            ("/v1/chat/completions", ChatCompletionRequest, "Create a chat completion"),
            ("/v1/completions", CompletionRequest, "Create a completion"),
            ("/v1/responses", ResponsesRequest, "Create a response (OpenAI's Responses API)"),
            ("/v1/messages", MessagesRequest, "Create a message (Anthropic's Messages API)"),
            ("/v1/embeddings", EmbeddingRequest, "Create embeddings (an embed engine)"),
            ("/v1/rerank", RerankRequest, "Rerank documents by relevance to a query (a score or embed engine)"),
            ("/v1/score", ScoreRequest, "Score documents against a query (a score or embed engine)"),
        ],
    )
    app.get("/v1/models")(list_models)
    app.get("/v1/models/{model:path}")(retrieve_model)
    app.get("/health")(health)
    app.get("/health/live")(liveness)
    app.get("/metrics")(metrics)
    app.get("/version")(version)
    return app


def _model_card(request: Request, name: str) -> dict[str, Any]:
    """The base model's card, or a LoRA adapter's (naming the base as its `parent`, as vLLM does)."""
    state = server_state(request)
    base = state.served_model_name
    card: dict[str, Any] = {"id": name, "object": "model", "created": request.app.state.created, "owned_by": "asyncllm"}
    if state.engine is not None:  # vLLM's field: the longest prompt + output a request may have
        card["max_model_len"] = state.engine.runtime.max_model_len
    return card if name == base else {**card, "parent": base}


async def list_models(request: Request) -> JSONResponse:
    state = server_state(request)
    names = [state.served_model_name, *state.adapters()]
    return JSONResponse({"object": "list", "data": [_model_card(request, name) for name in names]})


async def retrieve_model(model: str, request: Request) -> JSONResponse:
    server_state(request).resolve(model)  # 404 model_not_found unless it is the base model or an adapter
    return JSONResponse(_model_card(request, model))


async def health(request: Request) -> Response:
    """Readiness: 200 while the engine takes requests; 503 while it loads, once it is dead, while a step is
    stuck past the engine's bound (ASYNCLLM_MAX_STEP_SECONDS), and while it drains. Reads flags: never waits
    behind work."""
    engine = server_state(request).engine
    if engine is None:
        return OpenAIError("the engine is not started", status=503, type="service_unavailable").response()
    try:
        await engine.check_health()
    except EngineDeadError as exc:
        return engine_dead(exc).response()
    return JSONResponse({"status": "ok"})


async def liveness(request: Request) -> Response:
    """Liveness: 503 only when the engine is dead or a step is stuck (restarting the process is the cure);
    200 while it loads or drains, when restarting it would only lose work."""
    engine = server_state(request).engine
    if engine is None:
        return JSONResponse({"status": "starting"})
    try:
        await engine.check_health()
    except EngineDrainingError:
        return JSONResponse({"status": "draining"})
    except EngineDeadError as exc:
        return engine_dead(exc).response()
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
