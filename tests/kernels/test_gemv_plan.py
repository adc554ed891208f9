"""kernels/gemv_plan.py: configs refuse values the kernel cannot take, naming the field; a layer shape's tuned
config is what the launch runs; the split nears the config's programs per SM and covers K in whole tiles."""

from __future__ import annotations

import pytest

from asyncllm.kernels import gemv_plan as plans


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("block_n", 48, "a power of two from 16 to 256"),
        ("block_n", 8, "a power of two from 16 to 256"),
        ("num_warps", 3, "a power of two from 1 to 8"),
        ("row_bytes", 1024, "a power of two from 64 to 512"),
        ("programs_per_sm", 0, "an integer from 1 to 64"),
        ("max_split", 2.0, "an integer from 1 to 64"),
        ("fold_offsets", 1, "True or False"),
    ],
)
def test_bad_config_names_the_field(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=rf"GemvConfig\.{field}={value!r}: expected {expected}"):
        plans.GemvConfig(**{field: value})  # type: ignore[arg-type]


def test_a_tuned_shape_runs_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    tuned = plans.GemvConfig(block_n=64, num_warps=4, row_bytes=256)
    monkeypatch.setitem(plans.TUNED_CONFIGS, ("int4", 24576, 4096), tuned)
    assert plans.config_for(4, 24576, 4096) == tuned
    assert plans.config_for(plans.E4M3, 24576, 2048) == plans.DEFAULT_CONFIG  # an untuned shape: the default
    assert plans.config_for(plans.E4M3, 24576, 4096) == plans.TUNED_CONFIGS[("fp8", 24576, 4096)]  # its own kind


@pytest.mark.parametrize("config", [plans.DEFAULT_CONFIG, *plans.candidate_configs(4)[::7]], ids=str)
def test_split_nears_the_target_and_covers_k(config: plans.GemvConfig) -> None:
    for n, k, kind, group in [(24576, 4096, 4, 128), (1024, 3072, plans.FLOAT16, 3072), (4096, 4096, 0, 4096)]:
        plan = plans.gemv_plan(1, n, k, kind, group, 132, config=config)
        assert plan is not None and plan.config == config
        per_tile = plan.groups * plan.group_words * plans.codes_per_unit(kind)
        tiles = -(-k // per_tile)
        assert plan.split * plan.tiles_per_split >= tiles > (plan.split - 1) * plan.tiles_per_split
        wanted = min(config.max_split, -(-config.programs_per_sm * 132 // -(-n // config.block_n)), tiles)
        assert wanted // 2 < plan.split <= wanted  # whole, equal tiles per split: at most halved


def test_row_bytes_sets_the_k_tile() -> None:
    """int4 in groups of 128: 128-byte rows are two groups of 16 words, 256-byte rows four."""
    assert plans.tile_shape(4096, 128, 4, 128) == (2, 16)
    assert plans.tile_shape(4096, 128, 4, 256) == (4, 16)
    assert plans.tile_shape(4096, 4096, plans.FLOAT16, 128) == (1, 64)  # 64 bfloat16 values
    assert plans.tile_shape(4096, 4096, plans.FLOAT32, 256) == (1, 64)
    assert plans.tile_shape(200, 40, 8, 128) is None
