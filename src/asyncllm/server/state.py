"""What every handler of one app shares: the engine, the served model name, metrics and token strings.

Owns the two checks every generation endpoint starts with: the engine is there (else 503),
and the request names the served model or one of its LoRA adapters (else 404 model_not_found).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from asyncllm import AsyncLLMEngine
from asyncllm.errors import EngineDeadError
from asyncllm.server.errors import OpenAIError
from asyncllm.server.logprobs import TokenStrings
from asyncllm.server.metrics import ServerMetrics


@dataclass
class ServerState:
    served_model_name: str
    metrics: ServerMetrics
    engine: AsyncLLMEngine | None = None  # None until the lifespan has built it
    chat_template: str | None = None  # replaces the model's own (create_app's `chat_template`)
    request_timeout: float | None = None  # seconds: a request's default and longest timeout (None: none)
    token_strings: TokenStrings = field(default_factory=lambda: TokenStrings(None))

    def attach(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.token_strings = TokenStrings(engine.tokenizer)

    def timeout_for(self, asked: float | None) -> float | None:
        """A request's timeout: what it asked for, at most the server's (`request_timeout`), which is also
        the default; 400 naming `timeout` for a value that is not seconds > 0."""
        if asked is not None and not 0 < asked < float("inf"):  # NaN too
            raise OpenAIError(f"timeout={asked} is invalid: give seconds > 0", param="timeout")
        limit = self.request_timeout
        if asked is None or (limit is not None and asked > limit):
            return limit
        return asked

    def resolve(self, model: str) -> tuple[AsyncLLMEngine, str | None]:
        """The engine, and the LoRA adapter `model` names (None: the base model)."""
        adapters = self.adapters()
        if model != self.served_model_name and model not in adapters:
            served = ", ".join(f"`{name}`" for name in [self.served_model_name, *adapters])
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves {served}.",
                status=404,
                param="model",
                code="model_not_found",
            )
        engine = self.engine
        if engine is None:
            raise OpenAIError("the engine is not started", status=503, type="service_unavailable")
        # A dead engine refuses the request itself: add_request raises EngineDeadError (503).
        return engine, None if model == self.served_model_name else model

    def adapters(self) -> list[str]:
        """The LoRA adapters served beside the base model, by name (the engine's, as added)."""
        return self.engine.list_loras() if self.engine is not None else []

    def stats(self) -> dict[str, float | int]:
        if self.engine is None:
            raise EngineDeadError("the engine is not started")
        return self.engine.stats()


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.asyncllm
    return state
