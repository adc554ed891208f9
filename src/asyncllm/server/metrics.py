"""Prometheus metrics of one app, on its own registry (never the process-global one: two apps, two sets),
under vLLM's names, labels and buckets (`vllm:*`, labelled `model_name` and `engine`), so dashboards built for
vLLM read them unchanged; what vLLM has no metric for keeps an `asyncllm_` name.

Owns the metric names, the per-request tracker that feeds counters and latency histograms as chunks pass
and logs one line when its request ends (INFO on `asyncllm.server`), and a collector that reads
`engine.stats()` at scrape time for the gauges and the engine's own counters. The two metrics fed per chunk
(generated tokens, the gap between tokens) are plain counts under one lock (`TokenMetrics`), rendered at
scrape time: prometheus_client's own histogram walks its buckets in Python, a cost paid per token. Knows
nothing of OpenAI shapes.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from asyncllm.core.engine_stats import SPEC_POSITION_KEY
from asyncllm.outputs import RequestMetrics, StreamOutput
from asyncllm.server.pooling_metrics import PoolingMetrics

logger = logging.getLogger("asyncllm.server")
# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same boundaries.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
# vLLM's 1-2-5 token-count buckets go up to max_model_len; these to a million tokens, whatever the model.
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
LABELS = ["model_name", "engine"]
ENGINE = "0"  # vLLM's engine index: one engine core per app (a ReplicaPool's stats are pooled)


class ServerMetrics:
    """`metrics.track()` per engine request; `metrics.render()` for GET /metrics."""

    def __init__(self, stats: Callable[[], dict[str, float | int]], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": ENGINE}
        reg = self.registry
        self.requests = Counter(
            "vllm:request_success",
            "Requests ended, by finish reason (stop, length, abort for clients that left, timeout, error)",
            [*LABELS, "finished_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", LABELS, registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(**labels)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Request arrival in the engine to its first token",
            _TTFT_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Request arrival in the engine to its last token",
            _E2E_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS
        )
        self.tokens = TokenMetrics(_ITL_BUCKETS)
        reg.register(_TokenMetricsCollector(self.tokens, model_name))
        self.model_name = model_name
        reg.register(_EngineStatsCollector(stats, model_name))
        # /v1/embeddings, /v1/rerank, /v1/score: their inputs count as engine requests too
        self.pooling = PoolingMetrics(reg, model_name, ENGINE, self.requests, self.prompt_tokens)

    def track(self, request_id: str = "") -> RequestTracker:
        return RequestTracker(self, request_id)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Feeds one engine request's chunks into the metrics; `end()` records how it ended, exactly once."""

    __slots__ = ("_behind_first", "_ended", "_last", "_metrics", "_num_tokens", "_start", "request_id")

    def __init__(self, metrics: ServerMetrics, request_id: str = "") -> None:
        self._metrics = metrics
        self.request_id = request_id
        self._start = time.perf_counter()
        self._last: float | None = None  # when the previous chunk with tokens arrived
        self._num_tokens = 0
        self._behind_first = 0  # tokens that came in the first chunk after its first token: no gap seen here
        self._ended = False

    def observe(self, chunk: StreamOutput) -> None:
        m = self._metrics
        n = len(chunk.token_ids)
        if n:
            self._num_tokens += n
            now = time.perf_counter()
            if self._last is None:
                self._behind_first = n - 1
                m.tokens.add(n, None, 0)
            else:
                m.tokens.add(n, (now - self._last) / n, n)
            self._last = now
        if chunk.finish_reason is not None:
            metrics = chunk.metrics
            if metrics is not None:
                m.prompt_tokens.inc(metrics.num_prompt_tokens)
                m.request_prompt_tokens.observe(metrics.num_prompt_tokens)
                m.request_generation_tokens.observe(metrics.num_generated_tokens)
                if metrics.time_to_first_token is not None:
                    m.ttft.observe(metrics.time_to_first_token)
                if metrics.e2e_latency is not None:
                    m.e2e.observe(metrics.e2e_latency)
                self._observe_behind_first(metrics)
            self.end(chunk.finish_reason, metrics)

    def _observe_behind_first(self, metrics: RequestMetrics) -> None:
        """Tokens merged into the first chunk (a consumer that read late, a non-streamed request) get the
        request's mean gap after its first token, as the engine timed it: every token after the first is one
        observation, however the reader kept up (regression: a non-streamed request read in one chunk
        counted none)."""
        ttft, e2e, generated = metrics.time_to_first_token, metrics.e2e_latency, metrics.num_generated_tokens
        if self._behind_first and ttft is not None and e2e is not None and generated > 1:
            self._metrics.tokens.add(0, max(e2e - ttft, 0.0) / (generated - 1), self._behind_first)
        self._behind_first = 0

    def end(self, reason: str, metrics: RequestMetrics | None = None) -> None:
        """ "stop", "length", "timeout", "abort" (the client left) or "error" (the engine died)."""
        if not self._ended:
            self._ended = True
            m = self._metrics
            m.requests.labels(model_name=m.model_name, engine=ENGINE, finished_reason=reason).inc()
            if logger.isEnabledFor(logging.INFO):
                self._log(reason, metrics)

    def _log(self, reason: str, metrics: RequestMetrics | None) -> None:
        if metrics is None:  # it ended before the engine finished it: what the server saw
            seconds = time.perf_counter() - self._start
            logger.info("%s: %s, %d output tokens, total %.3f s", self.request_id, reason, self._num_tokens, seconds)
            return
        ttft = "-" if metrics.time_to_first_token is None else f"{metrics.time_to_first_token:.3f} s"
        e2e = "-" if metrics.e2e_latency is None else f"{metrics.e2e_latency:.3f} s"
        logger.info(
            "%s: %s, %d prompt + %d output tokens, TTFT %s, total %s",
            self.request_id,
            reason,
            metrics.num_prompt_tokens,
            metrics.num_generated_tokens,
            ttft,
            e2e,
        )


class TokenMetrics:
    """Generated tokens and the inter-token latency histogram (a merged chunk's gap shared by its tokens),
    counted under one lock from any thread; `_TokenMetricsCollector` renders them."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self.bounds = buckets  # upper bounds, ascending; +Inf is implied
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.gap_sum = 0.0
        self.num_tokens = 0

    def add(self, n: int, gap: float | None, times: int) -> None:
        """`n` more tokens, and `times` observations of `gap` between tokens."""
        with self._lock:
            self.num_tokens += n
            if gap is not None and times:
                self.counts[bisect.bisect_left(self.bounds, gap)] += times
                self.gap_sum += gap * times

    def snapshot(self) -> tuple[int, list[int], float]:
        with self._lock:
            return self.num_tokens, list(self.counts), self.gap_sum


class _TokenMetricsCollector(Collector):
    def __init__(self, tokens: TokenMetrics, model_name: str) -> None:
        self._tokens = tokens
        self._model_name = model_name

    def describe(self) -> list[Metric]:
        return list(self.collect())  # fixed names: the registry checks them for clashes once

    def collect(self) -> Iterator[Metric]:
        num_tokens, counts, gap_sum = self._tokens.snapshot()
        values = [self._model_name, ENGINE]
        generated = CounterMetricFamily("vllm:generation_tokens", "Generated tokens", labels=LABELS)
        generated.add_metric(values, float(num_tokens))
        yield generated
        cumulative, buckets = 0, []
        for bound, count in zip((*map(floatToGoString, self._tokens.bounds), "+Inf"), counts):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        # vLLM's name, and its older one that its Grafana dashboard still reads: the same observations.
        for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
            itl = HistogramMetricFamily(
                name,
                "Time between tokens as the server receives them (a merged chunk's gap is shared by its tokens)",
                labels=LABELS,
            )
            itl.add_metric(values, buckets, gap_sum)
            yield itl


_TIER_HITS = "prefix_cache_tier_hit_tokens"  # host and disk hits together (vLLM's external prefix cache hits)


class _EngineStatsCollector(Collector):
    """Gauges read from the engine's published stats snapshot at scrape time (never waits on a step)."""

    def __init__(self, stats: Callable[[], dict[str, float | int]], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # gauges come and go with the engine: nothing to check for name clashes up front

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # no engine yet (before startup) or gone: no gauges rather than a failed scrape
            return
        if "prefix_cache_host_hit_tokens" in stats:
            stats = {**stats, _TIER_HITS: stats["prefix_cache_host_hit_tokens"] + stats["prefix_cache_disk_hit_tokens"]}
        total, free = stats.get("num_total_blocks"), stats.get("num_free_blocks")
        usage = 1.0 - free / total if total and free is not None else None
        values = [self._model_name, ENGINE]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch", stats.get("num_running")),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled", stats.get("num_waiting")),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block in use", usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name, which its dashboard reads)", usage),
        ):
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=LABELS)
                family.add_metric(values, float(value))
                yield family
        for name, doc, key in (
            ("vllm:num_preemptions", "Requests preempted", "num_preemptions"),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queried_tokens"),
            ("vllm:prefix_cache_hits", "Prompt tokens the prefix cache served", "prefix_cache_hit_tokens"),
            # The KV tiers below the device (vLLM counts a KV connector's hits as external, in one counter).
            ("vllm:external_prefix_cache_hits", "Prompt tokens restored from host memory or disk", _TIER_HITS),
            (
                "asyncllm_prefix_cache_host_hits",
                "Prompt tokens restored from host memory",
                "prefix_cache_host_hit_tokens",
            ),
            ("asyncllm_prefix_cache_disk_hits", "Prompt tokens restored from disk", "prefix_cache_disk_hit_tokens"),
        ):
            if stats.get(key) is not None:
                counter = CounterMetricFamily(name, doc, labels=LABELS)
                counter.add_metric(values, float(stats[key]))
                yield counter
        yield from _speculation(stats, values)
        # asyncllm's own (vLLM has no such metric): the front's queue and its refusals.
        if stats.get("num_queued") is not None:
            queued = GaugeMetricFamily(
                "asyncllm_num_requests_queued",
                "Requests accepted and not started yet (what max_waiting_requests bounds)",
                labels=["model_name"],
            )
            queued.add_metric([self._model_name], float(stats["num_queued"]))
            yield queued
        if stats.get("num_rejected") is not None:
            rejected = CounterMetricFamily(
                "asyncllm_num_requests_rejected",
                "Requests refused at once because max_waiting_requests waited (429)",
                labels=["model_name"],
            )
            rejected.add_metric([self._model_name], float(stats["num_rejected"]))
            yield rejected


def _speculation(stats: dict[str, float | int], values: list[str]) -> Iterator[Metric]:
    """Speculative decoding's counters under vLLM's names, where the engine speculates (it reports accepted
    drafts by position): proposals, drafts, accepted drafts, and accepted drafts by position."""
    positions = sorted(
        (int(key.removeprefix(SPEC_POSITION_KEY)), value)
        for key, value in stats.items()
        if key.startswith(SPEC_POSITION_KEY)
    )
    if not positions:
        return
    for name, doc, key in (
        ("vllm:spec_decode_num_drafts", "Proposals verified (a request's drafts in one step)", "spec_num_drafts"),
        ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", "spec_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", "spec_accepted_tokens"),
    ):
        counter = CounterMetricFamily(name, doc, labels=LABELS)
        counter.add_metric(values, float(stats.get(key, 0)))
        yield counter
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the proposal",
        labels=[*LABELS, "position"],
    )
    for position, value in positions:
        per_position.add_metric([*values, str(position)], float(value))
    yield per_position
