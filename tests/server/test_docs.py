"""docs/server.md's snippets run as written (the port and model name swapped for the test server's), and
examples/openai_client.py and examples/openai_tools.py run against a tiny checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

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


def test_openai_snippet(server: RunningServer) -> None:
    code = _block("python", "OpenAI(", server)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\[\d+ prompt \+ \d+ completion tokens\]", out.stdout), out.stdout


def test_openai_client_example(tiny_model: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "openai_client.py"), str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "completion_tokens=16" in proc.stdout.splitlines()[-1], proc.stdout  # the completion's usage


def test_openai_tools_example(tmp_path: Path, structured_output_enforced: bool) -> None:
    model = build_checkpoint(tmp_path / "qwen3", "qwen3", max_position_embeddings=2048)  # room for the tools
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "openai_tools.py"), str(model)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    if not structured_output_enforced:
        return
    assert lines[0].startswith("parsed: Person(name="), lines  # a random model's reply, parsed all the same
    calls = [line for line in lines if line.startswith("tool call: get_weather(")]
    assert calls and any(line.startswith("answer: ") for line in lines), lines
    arguments = json.loads(calls[0].removeprefix("tool call: get_weather(").removesuffix(")"))
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
