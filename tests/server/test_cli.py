"""`asyncllm serve` end to end in a fresh process (the engine built before uvicorn starts and closed after it
stops, Ctrl-C exits cleanly, the start-up banner and one log line per request), its failures in one line with
the documented exit code (docs/cli.md), its port checked before the model loads, and the layer rule: the
server never imports torch."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from asyncllm.cli import main
from asyncllm.console import EXIT_FAILED, EXIT_USAGE
from asyncllm.errors import InvalidConfigError
from asyncllm.server.cli import build_parser, core_placement, served_model_name
from asyncllm.server.engine_flags import engine_arg_specs, engine_args_from
from tests.server.serving import core_processes, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_serve_a_checkpoint_from_the_command_line(tiny_model: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(tiny_model), "--port", str(port)]
    cmd += ["--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4", "--no-enable-prefix-caching"]
    cmd += ["--api-key", "cli-key", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert len(core_processes(proc.pid)) == 1  # the server's default: the engine core in a process of its own
        base_url = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=base_url, api_key="cli-key", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == [tiny_model.name]  # the checkpoint's name by default
            r = client.chat.completions.create(
                model=tiny_model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
            )
            assert r.usage is not None and r.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # The banner: what was loaded, on what, the KV cache, the phases; where to send requests and which name.
    assert "engine core: a process of its own" in err, err
    assert "engine ready in " in err and "(Qwen3ForCausalLM)" in err, err
    assert "cpu, float32, torch attention" in err and "KV cache 256 tokens (64 blocks of 4" in err, err
    phases = r"start-up: import [\d.]+ s, open [\d.]+ s, load [\d.]+ s, kv_cache [\d.]+ s, tokenizer [\d.]+ s, other"
    assert re.search(phases, err), err
    assert f'at http://127.0.0.1:{port}/v1: clients send "model": "{tiny_model.name}" (with the API key)' in err, err
    assert re.search(r"ready in [\d.]+ s \(engine [\d.]+ s", err), err
    # One line per finished request: id, tokens in and out, time to first token, duration, finish reason.
    assert re.search(r"chatcmpl-\S+-0: length, \d+ prompt \+ 3 output tokens, TTFT [\d.]+ s, total [\d.]+ s", err), err


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("asyncllm: ")]
    assert len(lines) == 1, err
    return lines[0]


def _unsupported_checkpoint(path: Path) -> Path:
    """A GPT-2 config.json: it fails as soon as the engine opens it (after the port check)."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_head=2, n_embd=8, architectures=["GPT2LMHeadModel"]).save_pretrained(path)
    return path


def test_bad_arguments_fail_in_one_line_with_their_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quiet = ["--log-level", "warning", "--port", str(free_port())]
    assert main(["serve", str(tmp_path / "nowhere"), *quiet]) == EXIT_FAILED
    assert "nowhere" in _one_line(capsys.readouterr().err)
    assert main(["serve", str(tmp_path), "--block-size", "3", *quiet]) == EXIT_USAGE  # before loading
    assert "block_size=3 is invalid" in _one_line(capsys.readouterr().err)


@pytest.mark.slow
def test_a_model_that_fails_to_load_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a failed start-up printed uvicorn's ~40-line traceback of the app's lifespan. The engine
    core's process (the default) sends its load error back to the server, which reports it so."""
    model = _unsupported_checkpoint(tmp_path / "gpt2")
    assert main(["serve", str(model), "--device", "cpu", "--log-level", "warning", "--port", str(free_port())]) == 1
    assert "'GPT2LMHeadModel' is not supported" in _one_line(capsys.readouterr().err)


def test_a_missing_device_is_one_line(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA device")
    argv = ["serve", str(tiny_model), "--device", "cuda", "--log-level", "warning", "--port", str(free_port())]
    argv += ["--no-core-process"]  # the message is the point; a core process would add its start (seconds)
    assert main(argv) == EXIT_FAILED
    assert "device='cuda' was asked for but torch sees no CUDA device" in _one_line(capsys.readouterr().err)


def test_max_model_len_beyond_the_model_is_a_usage_error(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", str(tiny_model), "--device", "cpu", "--max-model-len", "100000", "--log-level", "warning"]
    argv += ["--no-core-process"]  # as above
    assert main([*argv, "--port", str(free_port())]) == EXIT_USAGE
    assert "max_model_len=100000 exceeds the model's max_position_embeddings (512)" in _one_line(
        capsys.readouterr().err
    )


def test_a_busy_port_fails_before_the_model_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: the server loaded the model (15-20 s) before finding its port taken. The model here would
    fail to load (exit 1): exit 2 and the port's message prove the port was checked first."""
    model = _unsupported_checkpoint(tmp_path / "gpt2")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", str(model), "--port", str(port), "--log-level", "warning"]) == EXIT_USAGE
        assert time.monotonic() - start < 5
    assert f"cannot listen on 127.0.0.1:{port}" in _one_line(capsys.readouterr().err)


def test_the_built_in_model_is_served_under_the_name_the_docs_send() -> None:
    """Regression: docs/server.md's curl sent "smollm2" and plain `asyncllm serve` served the file's name (404)."""
    doc = (ROOT / "docs" / "server.md").read_text()
    (curl,) = [b for b in re.findall(r"```bash\n(.*?)```", doc, flags=re.S) if "curl" in b]
    sent = re.search(r'"model": "([^"]+)"', curl)
    assert sent is not None and served_model_name(build_parser().parse_args([])) == sent.group(1)
    assert served_model_name(build_parser().parse_args(["/models/Qwen3-0.6B"])) == "Qwen3-0.6B"
    assert served_model_name(build_parser().parse_args(["m.gguf", "--served-model-name", "x"])) == "x"


def test_the_engine_core_runs_in_its_own_process_unless_told_or_on_replicas() -> None:
    """The server's default is `core_process=True`; `--no-core-process` keeps the step thread; `--replicas`
    leaves it to the pool (whose replicas run their cores in Ray actors) and refuses an explicit one."""
    parser = build_parser()

    def placed(*argv: str) -> tuple[str, dict[str, Any]]:
        args = parser.parse_args(["m", *argv])
        engine_args = engine_args_from(args, engine_arg_specs())
        return core_placement(args, engine_args), engine_args

    assert placed() == ("a process of its own", {"core_process": True})
    assert placed("--core-process") == ("a process of its own", {"core_process": True})
    why, engine_args = placed("--no-core-process")
    assert engine_args == {"core_process": False} and "--no-core-process" in why
    why, engine_args = placed("--replicas", "2")
    assert engine_args == {} and "--replicas" in why
    assert placed("--replicas", "2", "--no-core-process")[1] == {}
    with pytest.raises(InvalidConfigError, match="--core-process and --replicas"):
        placed("--replicas", "2", "--core-process")


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path: Path) -> None:
    from asyncllm.server.cli import build_parser

    path = tmp_path / "tools.jinja"
    path.write_text("{{ messages[0].content }}", encoding="utf-8")
    assert build_parser().parse_args(["m", "--chat-template", str(path)]).chat_template == "{{ messages[0].content }}"
    assert build_parser().parse_args(["m", "--chat-template", "{{ x }}"]).chat_template == "{{ x }}"
    assert build_parser().parse_args(["m"]).chat_template is None


def test_server_import_leaves_torch_out() -> None:
    check = (
        "import sys, asyncllm.server, asyncllm.server.app, asyncllm.server.cli\n"
        "print(','.join(m for m in ('torch', 'transformers', 'triton') if m in sys.modules) or 'clean')"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "clean", f"imported at module import: {out.stdout.strip()}"
