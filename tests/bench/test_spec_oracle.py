"""bench/spec_oracle.py on CPU (toy shape): the oracle's drafts are all accepted, several tokens a step, the
same tokens as the plain run, so the device run measures what it claims."""

from __future__ import annotations

import pytest

from tests.bench.scripts import bench_script

pytestmark = pytest.mark.slow  # builds two engines


def test_the_oracle_drafts_are_all_accepted_on_cpu() -> None:
    with bench_script("spec_oracle", needs_tokenizer=True) as module:
        row = module.main(["--shape", "qwen3-tiny", "--device", "cpu", "--tokens", "12", "--rounds", "1"])
    assert row["same_tokens"] and row["tokens_per_verify_step"] > 2
    accepted, drafts = map(int, row["accepted_of_drafts"].split("/"))
    assert accepted == drafts > 0
