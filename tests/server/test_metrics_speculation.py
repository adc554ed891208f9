"""Speculative decoding's counters on /metrics under vLLM's names, read from the engine's stats."""

from __future__ import annotations

from asyncllm.server.metrics import ServerMetrics


def test_speculation_counters_use_vllms_names_and_positions() -> None:
    stats = {
        "spec_num_drafts": 10,
        "spec_draft_tokens": 40,
        "spec_accepted_tokens": 25,
        "spec_accepted_tokens_pos_0": 9,
        "spec_accepted_tokens_pos_1": 7,
        "spec_accepted_tokens_pos_2": 5,
        "spec_accepted_tokens_pos_3": 4,
    }
    text = ServerMetrics(lambda: stats, "m").render().decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0' in text
    for position, value in enumerate([9, 7, 5, 4]):
        line = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{position}"}}'
        assert f"{line} {value}.0" in text


def test_no_speculation_no_counters() -> None:
    text = ServerMetrics(lambda: {"spec_draft_tokens": 0, "spec_accepted_tokens": 0}, "m").render().decode()
    assert "spec_decode" not in text
