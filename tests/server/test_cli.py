"""`asyncllm serve` end to end in a fresh process (the engine built and closed in the app's lifespan, Ctrl-C
exits cleanly), its failures without a traceback, and the layer rule: the server never imports torch."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from asyncllm.cli import main
from tests.server.serving import free_port


def test_serve_a_checkpoint_from_the_command_line(tiny_model: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(tiny_model), "--port", str(port)]
    cmd += ["--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4", "--no-enable-prefix-caching"]
    cmd += ["--api-key", "cli-key", "--log-level", "warning"]
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


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path: Path) -> None:
    from asyncllm.server.cli import build_parser, read_chat_template

    path = tmp_path / "tools.jinja"
    path.write_text("{{ messages[0].content }}", encoding="utf-8")
    args = build_parser().parse_args(["m", "--chat-template", str(path)])
    assert read_chat_template(args.chat_template) == "{{ messages[0].content }}"
    assert read_chat_template("{{ x }}") == "{{ x }}" and read_chat_template(None) is None


def test_bad_arguments_fail_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path / "nowhere")]) == 1
    assert "nowhere" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--block-size", "3"]) == 1  # the engine's own check, before loading
    assert "block_size=3 is invalid" in capsys.readouterr().err


def test_server_import_leaves_torch_out() -> None:
    check = (
        "import sys, asyncllm.server, asyncllm.server.app, asyncllm.server.cli\n"
        "print(','.join(m for m in ('torch', 'transformers', 'triton') if m in sys.modules) or 'clean')"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "clean", f"imported at module import: {out.stdout.strip()}"
