"""Every example runs to completion against the tiny checkpoint (passed by argv), as a user would run it.

Each runs in its own interpreter, and they all start together the first time one is asked for: most of an
example's time is its interpreter importing torch, which the two cores of CI then do two at a time."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fixtures.scripts import started_together
from tests.fixtures.tiny_models import build_checkpoint

pytestmark = pytest.mark.slow  # starts processes or servers: seconds each

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# example -> whether it runs on a checkpoint of its own (the tool-calling one needs room for its tools)
RUNS = {
    "stream.py": False,
    "cancel.py": False,
    "embed_in_server.py": False,
    "chat.py": False,
    "json_extraction.py": False,
    "tool_call.py": True,
}


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], list[str]]]:
    """`run(name)`: the example's stdout lines, once it has exited cleanly."""
    roomy = build_checkpoint(tmp_path_factory.mktemp("qwen3-2048"), "qwen3", max_position_embeddings=2048)
    scripts = {name: (EXAMPLES / name, [str(roomy if own else tiny_model)]) for name, own in RUNS.items()}
    with started_together(scripts) as finish:
        yield lambda name: finish(name).splitlines()


def test_stream_example(run: Callable[[str], list[str]]) -> None:
    lines = run("stream.py")
    assert sum("48 tokens, first after" in line for line in lines) == 3
    assert sum(" -> " in line for line in lines) == 3
    stats = [line for line in lines if line.startswith("stats:")]
    assert len(stats) == 1 and "'num_running': 0" in stats[0]


def test_cancel_example(run: Callable[[str], list[str]]) -> None:
    lines = run("cancel.py")
    assert any(line.startswith("timeout: stopped after") for line in lines)
    assert "wait_for: gave up" in lines and "task cancelled: True" in lines
    assert "aborted by id, finish_reason: abort" in lines
    free = lines[-1].split("free blocks ")[1].split("/")
    assert lines[-1].startswith("running=0") and free[0] == free[1]


def test_embed_in_server_example(run: Callable[[str], list[str]]) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    lines = run("embed_in_server.py")
    *events, refused = [json.loads(line) for line in lines]
    assert events and events[-1]["finish_reason"] in ("stop", "length")
    assert all(e["finish_reason"] is None for e in events[:-1])
    # regression: a bad prompt was a 500 (the InvalidRequestError escaped the handler)
    assert refused["status"] == 400 and "prompt" in refused["error"], refused


def test_chat_example(run: Callable[[str], list[str]]) -> None:
    lines = run("chat.py")
    assert lines and any(line.strip() for line in lines), "the example printed no answer"


def test_json_extraction_example(run: Callable[[str], list[str]], structured_output_enforced: bool) -> None:
    lines = run("json_extraction.py")
    assert lines[0].startswith("reply: {"), lines
    if structured_output_enforced:  # even a random model's reply is a Person
        assert lines[1].startswith("parsed: Person(name="), lines


def test_tool_call_example(run: Callable[[str], list[str]], structured_output_enforced: bool) -> None:
    lines = run("tool_call.py")
    calls = [line for line in lines if line.startswith("tool call: get_weather(")]
    if structured_output_enforced:  # a random model calls too: the grammar leaves it nothing else
        assert calls, lines
        arguments = json.loads(calls[0].removeprefix("tool call: get_weather(").removesuffix(")"))
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert not calls and lines[0].startswith("no call; the model said"), lines
