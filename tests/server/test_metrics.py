"""GET /metrics: Prometheus text that prometheus_client's parser reads, on a registry of the app's own, under
vLLM's names and labels (its Grafana dashboard reads them unchanged: examples/grafana_dashboard.json), with
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
            "vllm:request_success_total": {"finished_reason": "length"},
            "vllm:prompt_tokens_total": {},
            "vllm:generation_tokens_total": {},
            "vllm:time_to_first_token_seconds_count": {},
            "vllm:inter_token_latency_seconds_count": {},
            "vllm:time_per_output_token_seconds_count": {},
            "vllm:e2e_request_latency_seconds_count": {},
            "vllm:request_prompt_tokens_count": {},
            "vllm:request_generation_tokens_sum": {},
            "vllm:prefix_cache_queries_total": {},
        }
        return {name: metric_value(server, name, **labels) for name, labels in names.items()}

    before = snapshot()
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=7, temperature=0, n=2)
    assert r.usage is not None
    after = snapshot()
    moved = {name: after[name] - before[name] for name in before}
    queried = moved.pop("vllm:prefix_cache_queries_total")
    assert moved == {
        "vllm:request_success_total": 2,
        "vllm:prompt_tokens_total": 2 * r.usage.prompt_tokens,  # per engine request: each sample prefills
        "vllm:generation_tokens_total": 14,
        "vllm:time_to_first_token_seconds_count": 2,
        "vllm:inter_token_latency_seconds_count": 12,  # one per token after each sample's first
        "vllm:time_per_output_token_seconds_count": 12,  # the same observations, vLLM's older name
        "vllm:e2e_request_latency_seconds_count": 2,
        "vllm:request_prompt_tokens_count": 2,
        "vllm:request_generation_tokens_sum": 14,
    }
    assert queried >= r.usage.prompt_tokens  # the prompt looked up at least once

    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels = {"model_name": MODEL, "engine": "0"}
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc"):
        family = families[f"vllm:{gauge}"]
        assert family.type == "gauge" and family.samples[0].labels == labels
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0.0  # idle: every block free
    hits, queries = families["vllm:prefix_cache_hits"], families["vllm:prefix_cache_queries"]
    assert hits.type == queries.type == "counter" and 0 <= hits.samples[0].value <= queries.samples[0].value
    ttft = families["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram" and ttft.samples[0].labels == {**labels, "le": "0.001"}  # vLLM's buckets
    assert len([s for s in ttft.samples if s.name.endswith("_bucket")]) == 23  # 22 bounds and +Inf


def test_each_app_has_its_own_registry(engine: AsyncLLMEngine) -> None:
    """Two apps in one process (the global registry would refuse the second set of names)."""
    a = create_app(engine, served_model_name="a").state.asyncllm.metrics
    b = create_app(engine, served_model_name="b").state.asyncllm.metrics
    assert a.registry is not b.registry
    a.track().end("stop")
    assert b'finished_reason="stop",model_name="a"} 1.0' in a.render()
    assert b"vllm:request_success_total{" not in b.render()


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
    samples = {s.name: s.value for s in families["vllm:inter_token_latency_seconds"].samples}
    assert samples["vllm:inter_token_latency_seconds_count"] == total - 1
    if chunks[0] > 1:  # the merged ones at the engine's mean gap: (0.7 - 0.1) / 6 s each
        assert samples["vllm:inter_token_latency_seconds_sum"] >= (chunks[0] - 1) * 0.1 - 1e-9


def test_the_example_dashboard_reads_only_series_the_server_exports(
    server: RunningServer, client: openai.OpenAI
) -> None:
    """examples/grafana_dashboard.json (and vLLM's own dashboard, whose names it uses): every series its
    queries read is on /metrics, labelled `model_name` as its variable selects."""
    import json
    import re
    from pathlib import Path

    client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3)
    dashboard = json.loads((Path(__file__).parents[2] / "examples" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    read = {name for expr in exprs for name in re.findall(r"vllm:[a-z0-9_:]+", expr)}
    text = httpx.get(f"{server.url}/metrics").text
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples if s.labels.get("model_name")}
    assert len(read) >= 12 and read <= exported, read - exported
