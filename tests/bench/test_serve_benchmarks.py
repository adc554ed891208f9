"""bench/serve_load.py, bench/serve_path.py and bench/core_pipe.py on CPU, so the device run does not find
their bugs first: the server (with its core in a process of its own) and the in-process engine stream the
same texts to the load's client processes, and the other two print their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, timeout: float = 240) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # three engines start: the server's front, its core process, and the in-process one
def test_serve_load_compares_server_and_engine_on_the_same_texts() -> None:
    args = ["--streams", "4", "--client-procs", "2", "--requests-per-stream", "2", "--max-tokens", "8"]
    rows = _run("serve_load.py", *args, "--check-text", "--threads", "1", "--server-flags=--core-process")
    modes = {row.get("mode"): row for row in rows if "mode" in row}
    assert modes["server"]["requests"] == modes["engine"]["requests"] == 8
    assert 0 < float(modes["server"]["client_cpu_max"]) < 1  # type: ignore[arg-type]
    (ratio,) = [row for row in rows if "ratio" in row]
    assert ratio["identical_text"] is True


def test_serve_path_and_core_pipe_print_their_figures() -> None:
    (path,) = _run("serve_path.py", "--requests", "8", "--tokens", "4", "--rounds", "1")
    assert float(path["cpu_us_per_event_median"]) > 0  # type: ignore[arg-type]
    rows = _run("core_pipe.py", "--batch", "1", "8", "--steps", "20")
    assert [row["batch"] for row in rows] == [1, 8] and all(int(row["bytes"]) > 0 for row in rows)  # type: ignore[call-overload]
