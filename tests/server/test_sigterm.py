"""SIGTERM drains `asyncllm serve` (issue 22): a real server process on the tiny checkpoint keeps
listening while it drains; the stream in flight completes whole, new requests and /health get 503, the
log says it drains, and the process exits cleanly once the stream is done."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.serving import core_processes, free_port

# The stream in flight must outlast the window between its first token and the refused request (the
# signal, the drain starting at the server's next tick, two health checks: 0.12 s on an idle 2-core
# machine, more on a busy one). 48 tokens of the tiny model fit inside it, so the drain had finished and
# the server closed its socket before the refused request was sent (CI, once); 500 take ~1.7 s.
_TOKENS = 500  # the prompt's 3 and these within the tiny model's 512 positions


@pytest.fixture(scope="module")
def servers(tiny_model: Path) -> Iterator[dict[bool, tuple[subprocess.Popen[str], int]]]:
    """core_process -> (the `asyncllm serve` process, its port): both start together the first time one is
    asked for (each start is mostly an interpreter importing torch, which two cores do two at a time); each
    test signals its own. Any left running at the end is killed."""
    procs: dict[bool, tuple[subprocess.Popen[str], int]] = {}
    for core_process in (True, False):
        while (port := free_port()) in [p for _, p in procs.values()]:
            pass
        cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(tiny_model), "--port", str(port), "--device", "cpu"]
        cmd += ["--num-kv-blocks", "256", "--block-size", "4", "--log-level", "info", "--drain-timeout", "60"]
        cmd += [] if core_process else ["--no-core-process"]
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        procs[core_process] = (popen, port)
    try:
        yield procs
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:  # its test did not run, or failed before the end: the group, core included
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


@pytest.mark.parametrize("core_process", [True, False], ids=["core-process", "step-thread"])
def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(
    tiny_model: Path, servers: dict[bool, tuple[subprocess.Popen[str], int]], core_process: bool
) -> None:
    """With the core in a process of its own (the server's default) the signal goes to the whole process
    group, as a service manager sends it: the core ignores it, serves the drain, and exits with the server."""
    proc, port = servers[core_process]
    url = f"http://127.0.0.1:{port}"
    core: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": tiny_model.name, "prompt": [5, 6, 7], "max_tokens": _TOKENS, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            events = []
            for line in lines:  # the first token is out: the request is in flight
                if line.startswith("data: "):
                    events.append(line)
                    break
            if core_process:
                core = core_processes(proc.pid)
                assert len(core) == 1
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                assert core_processes(proc.pid) == []
                proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while (health := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
                assert time.monotonic() - t0 < 5, "the drain did not begin"
                time.sleep(0.02)
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_draining"
            assert httpx.get(f"{url}/health/live", timeout=5).json() == {"status": "draining"}
            refused = httpx.post(
                f"{url}/v1/completions", json={"model": tiny_model.name, "prompt": [1, 2], "max_tokens": 2}, timeout=5
            )
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_draining"
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == _TOKENS  # every token, none cut by the shutdown
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM: draining:" in err and "drained (every request finished)" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for pid in core:
        with pytest.raises(ProcessLookupError):  # the core left with its server
            os.kill(pid, 0)
