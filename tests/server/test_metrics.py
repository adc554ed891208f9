"""GET /metrics: Prometheus text that prometheus_client's parser reads, on a registry of the app's own, with
counters that move as requests run and gauges read from engine.stats()."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncllm import AsyncLLMEngine, RequestMetrics, StreamOutput
from asyncllm.server import create_app
from tests.server.conftest import MODEL, metric_value
from tests.server.serving import RunningServer


def test_metrics_parse_and_move(server: RunningServer, client: openai.OpenAI) -> None:
    def snapshot() -> dict[str, float]:
        names = {
            "asyncllm_requests_total": {"finish_reason": "length"},
            "asyncllm_prompt_tokens_total": {},
            "asyncllm_generation_tokens_total": {},
            "asyncllm_time_to_first_token_seconds_count": {},
            "asyncllm_inter_token_latency_seconds_count": {},
            "asyncllm_e2e_request_latency_seconds_count": {},
        }
        return {name: metric_value(server, name, **labels) for name, labels in names.items()}

    before = snapshot()
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=7, temperature=0, n=2)
    assert r.usage is not None
    after = snapshot()
    moved = {name: after[name] - before[name] for name in before}
    assert moved == {
        "asyncllm_requests_total": 2,
        "asyncllm_prompt_tokens_total": 2 * r.usage.prompt_tokens,  # per engine request: each sample prefills
        "asyncllm_generation_tokens_total": 14,
        "asyncllm_time_to_first_token_seconds_count": 2,
        "asyncllm_inter_token_latency_seconds_count": 12,  # one per token after each sample's first
        "asyncllm_e2e_request_latency_seconds_count": 2,
    }

    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "prefix_cache_hit_rate"):
        family = families[f"asyncllm_{gauge}"]
        assert family.type == "gauge" and family.samples[0].labels == {"model_name": MODEL}
    assert families["asyncllm_kv_cache_usage_ratio"].samples[0].value == 0.0  # idle: every block free
    assert 0.0 <= families["asyncllm_prefix_cache_hit_rate"].samples[0].value <= 1.0
    assert families["asyncllm_time_to_first_token_seconds"].type == "histogram"


def test_each_app_has_its_own_registry(engine: AsyncLLMEngine) -> None:
    """Two apps in one process (the global registry would refuse the second set of names)."""
    a = create_app(engine, served_model_name="a").state.asyncllm.metrics
    b = create_app(engine, served_model_name="b").state.asyncllm.metrics
    assert a.registry is not b.registry
    a.track().end("stop")
    assert b'finish_reason="stop",model_name="a"} 1.0' in a.render()
    assert b"asyncllm_requests_total{" not in b.render()


def test_each_finished_request_logs_one_line(engine: AsyncLLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    """The request log (`--log-level info`): one line per engine request, however it ended, never two."""
    metrics = create_app(engine, served_model_name="m").state.asyncllm.metrics
    caplog.set_level(logging.INFO, logger="asyncllm.server")
    done = metrics.track("cmpl-1-0")
    done.observe(StreamOutput("cmpl-1-0", "hi", (5, 6)))
    done.observe(StreamOutput("cmpl-1-0", "!", (7,), "stop", RequestMetrics(0.012, 0.25, 9, 3, 0)))
    done.end("abort")  # the stream closing afterwards: already ended, nothing more
    metrics.track("cmpl-2-0").end("abort")  # the client left before any token
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncllm.server"]
    assert lines[0] == "cmpl-1-0: stop, 9 prompt + 3 output tokens, TTFT 0.012 s, total 0.250 s"
    assert lines[1].startswith("cmpl-2-0: abort, 0 output tokens, total ") and len(lines) == 2


@pytest.mark.parametrize("chunks", [(7,), (1, 6), (3, 2, 2)], ids=["one-chunk", "first-alone", "merged-first"])
def test_every_token_after_the_first_is_one_inter_token_observation(chunks: tuple[int, ...]) -> None:
    """However a reader kept up, a request of n tokens adds n - 1 inter-token observations (regression: a
    request read in one chunk, as a non-streamed one under load, added none, and the server test's count
    read 0). Tokens merged into the first chunk take the engine's mean gap after the first token."""
    from asyncllm.server.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: {}, "tiny")
    tracker = metrics.track("r")
    total, sent = sum(chunks), 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        done = RequestMetrics(0.1, 0.7, 5, total, 0) if last else None
        tracker.observe(StreamOutput("r", "", tuple(range(sent, sent + n)), "length" if last else None, done))
        sent += n
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {s.name: s.value for s in families["asyncllm_inter_token_latency_seconds"].samples}
    assert samples["asyncllm_inter_token_latency_seconds_count"] == total - 1
    if chunks[0] > 1:  # the merged ones at the engine's mean gap: (0.7 - 0.1) / 6 s each
        assert samples["asyncllm_inter_token_latency_seconds_sum"] >= (chunks[0] - 1) * 0.1 - 1e-9
