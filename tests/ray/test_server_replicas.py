"""`asyncllm serve --replicas 2` on the same server code: end to end from the command line, its argument
errors in one line, and the existing server tests (tests/server) passing against a pool of two replicas."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from asyncllm.console import EXIT_USAGE
from asyncllm.server.cli import main
from tests.server.serving import free_port

ROOT = Path(__file__).resolve().parents[2]


def _env(ray_cluster: str, **extra: str) -> dict[str, str]:
    """This process's environment, joined to the test cluster (and `src` importable, as it is here)."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "RAY_ADDRESS": ray_cluster, "PYTHONPATH": path, **extra}


def test_serve_with_two_replicas_from_the_command_line(ray_cluster: str, tiny_model: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(tiny_model), "--port", str(port), "--replicas", "2"]
    cmd += ["--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(ray_cluster))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as client:
            # ignore_eos: "length" is certain only if EOS, which an unseeded draw may give, cannot end a reply
            no_eos: dict[str, Any] = {"ignore_eos": True}
            r = client.completions.create(
                model=tiny_model.name, prompt=["Hi", "Hello there"], max_tokens=3, extra_body=no_eos
            )
            assert [c.finish_reason for c in r.choices] == ["length", "length"]
            stream = client.completions.create(
                model=tiny_model.name, prompt="Hi", max_tokens=4, stream=True, extra_body=no_eos
            )
            chunks = list(stream)
            assert chunks[-1].choices[0].finish_reason == "length"
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert "vllm:num_requests_running" in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"at http://127.0.0.1:{port}/v1" in err, err[-3000:]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "--replicas 0 is invalid: give a number of engines >= 1"),
        (["--ray-address", "auto"], "--ray-address places replicas on a Ray cluster: give --replicas N too"),
    ],
)
def test_replica_flags_refused_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model-not-needed", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() == f"asyncllm: {message}", err


@pytest.mark.slow
def test_the_server_tests_pass_against_two_replicas(ray_cluster: str) -> None:
    """tests/server in a fresh process, its shared engine a ReplicaPool of two: every test that uses that
    engine (tests/server/conftest.py leaves out those that build their own)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--durations=8", "tests/server"]
    env = _env(ray_cluster, ASYNCLLM_TEST_REPLICAS="2")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-3000:]
    print(proc.stdout[-2500:])  # its slowest tests, with -s or on failure
