"""/metrics for the KV tiers below the device: the hits restored from host memory and from disk, each an
asyncllm counter, and together vLLM's external prefix-cache hits (a KV connector's, in vLLM)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from asyncllm.server.metrics import ServerMetrics


def test_tier_hits_are_counters() -> None:
    stats = {"prefix_cache_hit_tokens": 80, "prefix_cache_host_hit_tokens": 48, "prefix_cache_disk_hit_tokens": 16}
    text = ServerMetrics(lambda: stats, "m").render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, value in (
        ("vllm:external_prefix_cache_hits", 64),
        ("asyncllm_prefix_cache_host_hits", 48),
        ("asyncllm_prefix_cache_disk_hits", 16),
    ):
        assert families[name].type == "counter" and families[name].samples[0].value == value, name


def test_no_tier_counters_without_the_stats() -> None:
    text = ServerMetrics(lambda: {"prefix_cache_hit_tokens": 3}, "m").render().decode()
    assert "external_prefix_cache_hits" not in text and "asyncllm_prefix_cache_host_hits" not in text
