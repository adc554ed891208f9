"""Prometheus metrics of the embedding and scoring endpoints, on the app's registry beside the generation
metrics (`metrics.py`). Each input of a call is one engine request, counted where vLLM counts its pooling
requests: `vllm:request_success` (finished_reason "stop") and `vllm:prompt_tokens`; vLLM has no per-endpoint
metric for them, so the calls themselves keep asyncllm names: `asyncllm_pooling_requests` by endpoint and
outcome, and `asyncllm_pooling_request_duration_seconds` by endpoint.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# A call's seconds, from the server's arrival to its answer: a few inputs in milliseconds, thousands in seconds.
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OUTCOMES = ("ok", "invalid", "overloaded", "timeout", "abort", "error")  # abort: the client left


class PoolingMetrics:
    """`record(...)` once per /v1/embeddings, /v1/rerank or /v1/score call."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, engine: str, requests: Counter, prompt_tokens: Counter
    ) -> None:
        self._model_name = model_name
        self._engine = engine  # vLLM's engine index label (metrics.ENGINE)
        self._requests = requests  # vllm:request_success, labelled by finished_reason
        self._prompt_tokens = prompt_tokens  # vllm:prompt_tokens, this model's child
        self._calls = Counter(
            "asyncllm_pooling_requests",
            "Embedding and scoring calls, by endpoint and outcome (ok, invalid, overloaded, timeout, abort, error)",
            ["model_name", "endpoint", "outcome"],
            registry=registry,
        )
        self._seconds = Histogram(
            "asyncllm_pooling_request_duration_seconds",
            "Embedding and scoring calls' time from arrival to answer, by endpoint (answered calls only)",
            ["model_name", "endpoint"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )

    def record(self, endpoint: str, outcome: str, seconds: float, num_inputs: int = 0, num_tokens: int = 0) -> None:
        assert outcome in OUTCOMES, outcome
        self._calls.labels(model_name=self._model_name, endpoint=endpoint, outcome=outcome).inc()
        if outcome == "ok":
            self._seconds.labels(model_name=self._model_name, endpoint=endpoint).observe(seconds)
            self._requests.labels(model_name=self._model_name, engine=self._engine, finished_reason="stop").inc(
                num_inputs
            )
            self._prompt_tokens.inc(num_tokens)
