"""bench/gemma3_w1_w5.py on CPU: its byte-count limits (the figures its docstring and shapes.W1_LIMIT quote),
and the script end to end on the toy `gemma3-tiny` shape (the real 262k vocabulary; needs the Qwen3
tokenizer, skipped without it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.scripts import bench_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_script("gemma3_w1_w5") as module:
        yield module


def test_limits_of_the_4b_shape(bench: ModuleType) -> None:
    from shapes import SHAPES, W1_LIMIT
    from w1_throughput import w1_requests

    cfg = SHAPES["gemma3-4b"]
    assert bench.weight_bytes(cfg) == pytest.approx(7.76e9, rel=1e-3)
    assert bench.w5_limit_ms(cfg) == pytest.approx(1.83, abs=0.01)
    # A key costs 4 KiB per layer: 34 layers up to the window, 5 (the global ones) past it.
    assert bench.kv_bytes_read(cfg, 1024) == 34 * 4096 * 1024
    assert bench.kv_bytes_read(cfg, 2048) - bench.kv_bytes_read(cfg, 1024) == 5 * 4096 * 1024
    prompts, params = w1_requests(256)
    limit = bench.w1_limit(cfg, [len(p) for p in prompts], [p.max_tokens for p in params])
    assert limit == pytest.approx(W1_LIMIT["gemma3-4b"], rel=0.01)


@pytest.mark.slow
def test_runs_on_cpu(bench: ModuleType, monkeypatch, capsys) -> None:
    from shapes import find_qwen3_tokenizer

    try:
        find_qwen3_tokenizer()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    argv = ["gemma3_w1_w5.py", "--shape", "gemma3-tiny", "--device", "cpu", "--num-seqs", "2"]
    monkeypatch.setattr("sys.argv", [*argv, "--w5-tokens", "4", "--max-tokens-cap", "4"])
    bench.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["workload"] for line in lines] == ["W5", "W1"]
    assert lines[1]["output_tokens"] == 8 and lines[1]["preemptions"] == 0
    assert lines[0]["ms_per_token"] > 0 and lines[1]["limit_tok_per_s"] > 0
