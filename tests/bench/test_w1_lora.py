"""bench/w1_lora.py on CPU (toy `qwen3-tiny` shape, a few short requests), so the device run does not find its
bugs first: the adapters it writes load (PEFT's format, every projection of the shape), and the mixed run
makes as many tokens as the base one."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.scripts import bench_script

pytestmark = pytest.mark.slow  # starts processes or servers: seconds each


@pytest.fixture(scope="module")
def w1_lora() -> Iterator[ModuleType]:
    with bench_script("w1_lora", needs_tokenizer=True) as module:
        yield module


def test_measure_runs_on_cpu(w1_lora: ModuleType) -> None:
    argv = ["--shape", "qwen3-tiny", "--device", "cpu", "--num-seqs", "4", "--max-tokens", "3", "--rounds", "1"]
    args = w1_lora.parser().parse_args([*argv, "--num-adapters", "2", "--max-model-len", "1100"])
    base = w1_lora.measure(args, "base")
    lora = w1_lora.measure(args, "lora")
    assert base["output_tokens"] == lora["output_tokens"] == 4 * 3
    assert lora["lora_tok_s"] > 0
