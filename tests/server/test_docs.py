"""docs/server.md's snippets run as written (the port and model name swapped for the test server's), and
examples/openai_client.py and examples/openai_tools.py run against a tiny checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fixtures.scripts import started_together
from tests.fixtures.tiny_models import build_checkpoint
from tests.server.conftest import MODEL
from tests.server.serving import RunningServer

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "server.md"


def _block(language: str, containing: str, server: RunningServer) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)
    (block,) = [b for b in blocks if containing in b]
    return block.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}").replace('"smollm2"', f'"{MODEL}"')


def test_curl_snippet(server: RunningServer) -> None:
    out = subprocess.run(["bash", "-c", _block("bash", "curl", server)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] <= 32


@pytest.mark.slow
def test_openai_snippet(server: RunningServer) -> None:
    code = _block("python", "OpenAI(", server)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\[\d+ prompt \+ \d+ completion tokens\]", out.stdout), out.stdout


@pytest.fixture(scope="module")
def examples(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], str]]:
    """`finish(name)`: the example's stdout once it exited cleanly. Both start together the first time one is
    asked for: each is mostly its interpreter's start, which two cores do two at a time."""
    roomy = build_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", max_position_embeddings=2048)  # tools fit
    scripts = {
        name: (ROOT / "examples" / name, [str(model)])
        for name, model in (("openai_client.py", tiny_model), ("openai_tools.py", roomy))
    }
    with started_together(scripts, timeout=180) as finish:
        yield finish


@pytest.mark.slow
def test_openai_client_example(examples: Callable[[str], str]) -> None:
    stdout = examples("openai_client.py")
    assert "completion_tokens=16" in stdout.splitlines()[-1], stdout  # the completion's usage


@pytest.mark.slow
def test_openai_tools_example(examples: Callable[[str], str], structured_output_enforced: bool) -> None:
    lines = examples("openai_tools.py").splitlines()
    if not structured_output_enforced:
        return
    assert lines[0].startswith("parsed: Person(name="), lines  # a random model's reply, parsed all the same
    calls = [line for line in lines if line.startswith("tool call: get_weather(")]
    assert calls and any(line.startswith("answer: ") for line in lines), lines
    arguments = json.loads(calls[0].removeprefix("tool call: get_weather(").removesuffix(")"))
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
