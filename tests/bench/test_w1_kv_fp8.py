"""bench/w1_kv_fp8.py on CPU (toy `qwen3-tiny` shape, a few short requests), so the device run does not find its
bugs first: both caches make the same number of tokens, and the bound counts the FP8 one's smaller reads."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.scripts import bench_script

pytestmark = pytest.mark.slow  # starts processes or servers: seconds each


@pytest.fixture(scope="module")
def w1_kv_fp8() -> Iterator[ModuleType]:
    with bench_script("w1_kv_fp8", needs_tokenizer=True) as module:
        yield module


def test_measure_runs_on_cpu(w1_kv_fp8: ModuleType) -> None:
    argv = ["--shape", "qwen3-tiny", "--device", "cpu", "--num-seqs", "4", "--max-tokens", "3", "--w5-tokens", "2"]
    args = w1_kv_fp8.parser().parse_args([*argv, "--max-model-len", "1100", "--engine-arg", "num_kv_blocks=512"])
    auto, fp8 = w1_kv_fp8.measure(args, "auto"), w1_kv_fp8.measure(args, "fp8")
    assert auto["w1_output_tokens"] == fp8["w1_output_tokens"] == 4 * 3
    assert fp8["kv_blocks"] == auto["kv_blocks"] == 512
    # Each key read in a quarter of float32's bytes: a higher bound from the same requests.
    assert fp8["w1_bound_tok_s"] > auto["w1_bound_tok_s"] and fp8["w5_ms_per_token"] > 0
