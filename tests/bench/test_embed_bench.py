"""bench/embed_throughput.py: its transformers batches stay within the token budget and keep every text, and
the script runs end to end on CPU at toy size (`--tiny`), one JSON line per shape."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.scripts import bench_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_script("embed_throughput") as module:
        yield module


def test_batches_cover_every_text_within_the_budget(bench: ModuleType) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(128, 512) for _ in range(500)] + [900]  # one longer than the budget: alone
    batches = bench.token_batches(lengths, 2048)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 2048 for b in batches if len(b) > 1)
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    inputs = bench.texts(20, 8, 12, 100, seed=3)
    assert inputs == bench.texts(20, 8, 12, 100, seed=3) and all(8 <= len(x) <= 12 for x in inputs)
    assert all(1 <= t < 100 for x in inputs for t in x)


@pytest.mark.slow
def test_runs_on_cpu_at_toy_size(bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["embed_throughput.py", "--tiny", "--device", "cpu", "--num-texts", "12"])
    bench.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["shape"] for line in lines] == ["qwen3-0.6b-tiny", "bert-base-tiny"]
    for line in lines:
        assert line["texts"] == 12 and line["asyncllm_texts_per_s"] > 0 and line["transformers_texts_per_s"] > 0
        assert line["ratio"] > 0
