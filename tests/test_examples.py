"""Every example runs to completion against the tiny checkpoint (passed by argv), as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.tiny_models import build_checkpoint

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(name: str, model: Path) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), str(model)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "never awaited" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_stream_example(tiny_model: Path) -> None:
    lines = _run("stream.py", tiny_model)
    assert sum("48 tokens, first after" in line for line in lines) == 3
    assert sum(" -> " in line for line in lines) == 3
    stats = [line for line in lines if line.startswith("stats:")]
    assert len(stats) == 1 and "'num_running': 0" in stats[0]


def test_cancel_example(tiny_model: Path) -> None:
    lines = _run("cancel.py", tiny_model)
    assert any(line.startswith("timeout: stopped after") for line in lines)
    assert "wait_for: gave up" in lines and "task cancelled: True" in lines
    assert "aborted by id, finish_reason: abort" in lines
    free = lines[-1].split("free blocks ")[1].split("/")
    assert lines[-1].startswith("running=0") and free[0] == free[1]


def test_embed_in_server_example(tiny_model: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    lines = _run("embed_in_server.py", tiny_model)
    *events, refused = [json.loads(line) for line in lines]
    assert events and events[-1]["finish_reason"] in ("stop", "length")
    assert all(e["finish_reason"] is None for e in events[:-1])
    # regression: a bad prompt was a 500 (the InvalidRequestError escaped the handler)
    assert refused["status"] == 400 and "prompt" in refused["error"], refused


def test_chat_example(tiny_model: Path) -> None:
    lines = _run("chat.py", tiny_model)
    assert lines and any(line.strip() for line in lines), "the example printed no answer"


def test_json_extraction_example(tiny_model: Path, structured_output_enforced: bool) -> None:
    lines = _run("json_extraction.py", tiny_model)
    assert lines[0].startswith("reply: {"), lines
    if structured_output_enforced:  # even a random model's reply is a Person
        assert lines[1].startswith("parsed: Person(name="), lines


def test_tool_call_example(tmp_path: Path, structured_output_enforced: bool) -> None:
    model = build_checkpoint(tmp_path / "qwen3", "qwen3", max_position_embeddings=2048)  # room for the tools
    lines = _run("tool_call.py", model)
    calls = [line for line in lines if line.startswith("tool call: get_weather(")]
    if structured_output_enforced:  # a random model calls too: the grammar leaves it nothing else
        assert calls, lines
        arguments = json.loads(calls[0].removeprefix("tool call: get_weather(").removesuffix(")"))
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert not calls and lines[0].startswith("no call; the model said"), lines
