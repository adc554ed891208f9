"""bench/kv_tiers.py on CPU (`--tiny`: qwen3-tiny, a few short conversations), so the device run does not find
its bugs first: the host tier serves returning turns, W1's distinct prompts hit nothing, the copies have a
bandwidth, and a restarted engine answers from disk."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.scripts import bench_script

pytestmark = pytest.mark.slow  # several engines: seconds


@pytest.fixture(scope="module")
def kv_tiers() -> Iterator[ModuleType]:
    with bench_script("kv_tiers") as module:
        yield module


def test_every_part_runs_on_cpu(kv_tiers: ModuleType, tmp_path) -> None:
    args = kv_tiers.settle(kv_tiers.parser().parse_args(["--tiny", "--disk-dir", str(tmp_path)]))
    runs = {kind: kv_tiers.measure(args, kind) for kind in kv_tiers.KINDS}
    out = kv_tiers.summary(args, runs)
    assert runs["on"]["w10"]["host_hit_tokens"] > 0 and runs["off"]["w10"]["host_hit_tokens"] == 0
    assert runs["on"]["w1"]["hit_tokens"] == runs["off"]["w1"]["hit_tokens"] == 0
    assert runs["on"]["w1"]["tokens"] == runs["off"]["w1"]["tokens"] == 4 * 4
    assert runs["disk_cold"]["disk_hit_tokens"] == 0 and runs["disk_warm"]["disk_hit_tokens"] >= 80
    assert out["restore_gb_s"] > 0 and out["w10_ttft_p50_on_over_off"] > 0 and out["disk_ttft_over_cold"] > 0


def test_the_restart_trace_shows_reads_restores_and_the_forward_pass(kv_tiers: ModuleType, tmp_path) -> None:
    from asyncllm.worker.kv_tiers import WorkerKVTiers

    untraced = WorkerKVTiers.before_forward
    args = kv_tiers.settle(kv_tiers.parser().parse_args(["--tiny", "--trace", "--disk-dir", str(tmp_path)]))
    kv_tiers.measure(args, "disk_cold")
    warm = kv_tiers.measure(args, "disk_warm")
    trace = "\n".join(warm["trace"])
    assert "reads: the last in" in trace and "restore" in trace and "forward rows=1" in trace, trace
    assert WorkerKVTiers.before_forward is untraced  # the trace put the worker's methods back
    assert warm["disk_hit_tokens"] > 0
