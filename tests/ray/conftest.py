"""One local Ray cluster for this folder (2 logical CPUs, no dashboard, a temporary directory), and one pool of
two replicas on the tiny Qwen3 checkpoint shared by the tests that need a real model. Tests that need Ray
skip, saying so, where it is not installed (the `ray` extra; `dev` includes it). Replicas reserve no CPU
(`num_cpus=0`): pools of several tests may live at once on the small machine CI runs on."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_CPU: dict[str, Any] = {"num_cpus": 0}
ENGINE_ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=1024, max_model_len=512)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This folder's tests start a Ray cluster: all `slow`, and under pytest-xdist (`--dist loadgroup`,
    scripts/test.sh) they share one worker, so the cluster and the pool below start once, not once per worker."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[str]:
    """The cluster's address (subprocesses join it through $RAY_ADDRESS)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (the `ray` extra: pip install -e '.[ray]')")
    temp = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths live under it
    # Replicas import test builders (tests.ray.builders): Ray's processes inherit this variable at start.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "src"), saved) if p)
    try:
        try:
            context = ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        yield str(context.address_info["gcs_address"])
        ray.shutdown()
    finally:  # removed even when Ray failed to start
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="package")
def tiny_pool(ray_cluster: str, tiny_model: Path) -> Iterator[Any]:
    from asyncllm.ray import ReplicaPool

    pool = ReplicaPool(str(tiny_model), num_replicas=2, ray_actor_options=NO_CPU, **ENGINE_ARGS)
    yield pool
    pool.shutdown()


def wait_idle(pool: Any, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Wait until no request is live and every ready replica runs nothing and has every block free."""
    deadline = time.monotonic() + timeout
    while True:
        rows = pool.replica_stats()
        idle = all(
            r["num_running"] == 0 and r["num_waiting"] == 0 and r["num_free_blocks"] == r["num_total_blocks"]
            for r in rows
            if r["ready"]
        )
        if idle and pool.num_live_requests == 0:
            return rows
        assert time.monotonic() < deadline, f"the pool is not idle after {timeout} s: {rows}"
        time.sleep(0.01)
