"""bench/moe_bench.py's limits, on CPU: the Qwen3-30B-A3B shape's parameter counts (30.5B in all, 3.0B read
per token at batch 1), the experts a batch touches, and W1's limit between the all-experts and top-k bounds."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.scripts import bench_script


@pytest.fixture(scope="module")
def moe_bench() -> Iterator[ModuleType]:
    with bench_script("moe_bench") as module:
        yield module


def test_qwen3_30b_a3b_counts(moe_bench: ModuleType) -> None:
    shape = moe_bench.MoEShape.of(moe_bench.SHAPES["qwen3-30b-a3b"])
    total = shape.layers * (shape.dense + shape.num_experts * shape.expert) + 2 * shape.head  # + the embedding
    assert round(total / 1e9, 2) == 30.53
    assert round(shape.active_params / 1e9, 2) == 3.04  # 48 x (attention 18.9M + router + 8 x 4.7M) + head
    assert shape.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2
    assert shape.experts_touched(1) == pytest.approx(8)
    assert shape.experts_touched(256) == pytest.approx(128, abs=1e-3)
    assert moe_bench.w5_limit_ms(shape, 128, 512) == pytest.approx(1.44, abs=0.01)


def test_w1_limit_lies_between_top_k_and_all_experts(moe_bench: ModuleType) -> None:
    shape = moe_bench.MoEShape.of(moe_bench.SHAPES["qwen3-30b-a3b"])
    prompts, outputs = [100] * 64, [200] * 64
    decode = moe_bench.w1_limit_s(shape, prompts, outputs)["decode_s"]
    steps = 199
    per_step = [shape.decode_step_bytes(rows, 64 * 250) / moe_bench.H200_COPY_BYTES_PER_S for rows in (1, 1000)]
    assert steps * per_step[0] < decode < steps * per_step[1]
