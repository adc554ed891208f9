"""bench/spec_eagle3.py on CPU (toy shape): the three engines give the same tokens, the oracle's verifying steps
several tokens each, the random head's one (its drafts are verified and refused), and every figure the device
run reports is there."""

from __future__ import annotations

import pytest

from tests.bench.scripts import bench_script

pytestmark = pytest.mark.slow  # builds three engines


def test_the_eagle3_costs_bench_runs_on_cpu() -> None:
    with bench_script("spec_eagle3", needs_tokenizer=True) as module:
        row = module.main(["--shape", "qwen3-tiny", "--device", "cpu", "--tokens", "12", "--rounds", "1", "--k", "3"])
    assert row["same_tokens"]
    assert row["oracle_tokens_per_step"] > 2 and row["eagle3_tokens_per_step"] >= 1
    assert row["plain_ms_per_step"] > 0 and row["verify_ms_per_step"] > 0 and row["eagle3_ms_per_step"] > 0
    assert {"speedup_at_2", "speedup_at_3", "speedup_at_3.5"} <= row.keys()
