"""The Ray examples run to completion against the tiny checkpoint, on this folder's cluster ($RAY_ADDRESS):
the pool (examples/ray_pool.py) and the server as a Ray Serve deployment (examples/ray_serve.py, when Ray
Serve's own dependencies are installed: `ray[serve]`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.serving import free_port

ROOT = Path(__file__).resolve().parents[2]


def _run(ray_cluster: str, *argv: str) -> list[str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "RAY_ADDRESS": ray_cluster, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_pool_example(ray_cluster: str, tiny_model: Path) -> None:
    lines = _run(ray_cluster, "examples/ray_pool.py", str(tiny_model))
    assert "cancelled: True" in lines, lines
    rows = [line for line in lines if line.startswith("replica ")]
    assert len(rows) == 2, lines
    for row in rows:  # every block free again, on both replicas
        free, total = row.split("free ")[1].split("/")
        assert free == total, row


@pytest.mark.slow
def test_ray_serve_example(ray_cluster: str, tiny_model: Path) -> None:
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Ray Serve's dependencies are not installed (pip install 'ray[serve]'): {exc}")
    lines = _run(ray_cluster, "examples/ray_serve.py", str(tiny_model), "--smoke", "--port", str(free_port()))
    assert any(line.startswith("reply: ") for line in lines), lines
