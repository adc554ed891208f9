"""bench/kernels/sweep_gemv.py on CPU: the table it prints is Python that kernels/gemv_plan.py can take as it is
(each key the kind name and layer shape `config_for` looks up, each value the config swept); every config it
sweeps is valid and plans every layer shape it sweeps. The timing itself needs CUDA (the script says so)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from asyncllm.kernels import gemv_plan as plans

KERNEL_BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels"


@pytest.fixture(scope="module")
def sweep() -> Iterator[ModuleType]:
    sys.path.insert(0, str(KERNEL_BENCH))
    try:
        yield importlib.import_module("sweep_gemv")
    finally:
        sys.path.remove(str(KERNEL_BENCH))
        sys.modules.pop("sweep_gemv", None)


def test_the_printed_table_is_the_gemv_plans_literal(sweep: ModuleType) -> None:
    best = plans.GemvConfig(block_n=64, num_warps=4, row_bytes=256, programs_per_sm=16, max_split=32)
    key = (plans.kind_name(sweep.KINDS["int4"]), 24576, 4096)
    source = sweep.format_table([(key, best, "qwen3-8b gate_up: 40.6 -> 20.1 us, 2.5 TB/s")])
    namespace: dict[str, object] = {"GemvConfig": plans.GemvConfig}
    exec(source, namespace)  # what a paste into kernels/gemv_plan.py defines
    assert namespace["TUNED_CONFIGS"] == {("int4", 24576, 4096): best}


def test_every_swept_config_plans_every_swept_shape(sweep: ModuleType) -> None:
    """Each tile at each target of programs per SM; integer codes with their offsets folded or not."""
    per_tile = len(plans.CANDIDATE_PROGRAMS_PER_SM)
    for name, kind in sweep.KINDS.items():
        configs = sweep.configs_for(kind)
        assert configs[0] == plans.DEFAULT_CONFIG and len(set(configs)) == len(configs)
        assert len(configs) == 1 + len(plans.CANDIDATE_TILES) * per_tile * (2 if name == "int4" else 1)
    for layers in sweep.SHAPES.values():
        for n, k in layers.values():
            for name, kind in sweep.KINDS.items():
                group = sweep.GROUP if name == "int4" else k
                for config in sweep.configs_for(kind):
                    plan = plans.gemv_plan(1, n, k, kind, group, 132, config=config)
                    assert plan is not None and plan.split <= config.max_split, (name, n, k, config)
