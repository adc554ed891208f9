"""bench/hostile_clients.py at a tiny scale, so the recorded run does not find its bugs first: the server
answers every hostile kind (a 4xx, or the connection closed), never a 5xx, and the summary has its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a server and its core process start
def test_hostile_clients_prints_the_ratio_and_no_server_error() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    args = ["--honest", "4", "--hostile", "12", "--max-tokens", "8", "--requests-per-stream", "1", "--rounds", "1"]
    args += ["--hostile-warmup", "1.5", "--oversized-mb", "4", "--hostile-interval", "0.3"]
    args += ["--kinds", "oversized", "deep", "surrogate", "trickle", "stall", "compile", "schema", "--hostile-spread"]
    args += ["--server-flags=--timeout-request-read 0.5"]  # the trickling and stalled clients are closed in time
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hostile_clients.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    summary = rows[-1]
    assert summary["server_errors"] == {} and summary["limit"] == 1.5
    assert summary["ratio"] > 0 and summary["itl_ms_p99_alone_median"] > 0
    answers = summary["hostile_answers"]
    for kind in ("deep", "surrogate"):
        assert answers.get(f"{kind}:400", 0) > 0, answers
    assert answers.get("oversized:413", 0) + answers.get("oversized:closed", 0) > 0, answers
    for kind in ("trickle", "stall"):  # the server closed them (a 408 first for the stalled body)
        assert answers.get(f"{kind}:closed", 0) + answers.get(f"{kind}:408", 0) > 0, answers
    for kind in ("compile", "schema"):  # answered (a 200), or still running when the run ended
        assert sum(n for key, n in answers.items() if key.startswith(f"{kind}:")) > 0, answers
    assert [row["run"] for row in rows[:-1]] == ["alone", "hostile", "alone"]
