"""LoRA adapters over HTTP: `/v1/models` lists each adapter (its `parent` the base model) as they are added and
removed; a request whose `model` is an adapter's name runs through it (the engine's own tokens, echoed under
that name), in completions and chat; an unknown name is a 404 naming what is served. `--lora-modules NAME=PATH`
serves adapters from the command line (turning LoRA on), and refuses a bad one in one line."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine, SamplingParams
from asyncllm.cli import main
from asyncllm.console import EXIT_USAGE
from asyncllm.errors import InvalidConfigError
from asyncllm.server import create_app
from asyncllm.server.cli import build_parser, lora_modules
from tests.server.serving import RunningServer, free_port, start_server

ARGS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, enable_lora=True, max_lora_rank=8)
PROMPT = [17, 4, 250, 99, 8, 61, 120]


@pytest.fixture(scope="module")
def lora_engine(tiny_model: Path, tiny_lora_adapters: dict[str, Path]) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(str(tiny_model), **ARGS)

    async def add() -> None:
        await engine.add_lora("a", tiny_lora_adapters["a"])
        await engine.add_lora("b", tiny_lora_adapters["b"])

    asyncio.run(add())
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def lora_server(lora_engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(lora_engine, served_model_name="tiny"))
    yield running
    running.stop()


@pytest.fixture
def client(lora_server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=lora_server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_models_lists_the_adapters_as_they_come_and_go(
    lora_engine: AsyncLLMEngine, client: openai.OpenAI, tiny_lora_adapters
) -> None:
    cards = client.models.list().data
    assert [m.id for m in cards] == ["tiny", "a", "b"]
    assert [getattr(m, "parent", None) for m in cards] == [None, "tiny", "tiny"]
    assert client.models.retrieve("b").id == "b"
    asyncio.run(lora_engine.add_lora("c", tiny_lora_adapters["c"]))
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b", "c"]
    asyncio.run(lora_engine.remove_lora("c"))
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]
    with pytest.raises(openai.NotFoundError, match="serves `tiny`, `a`, `b`"):
        client.models.retrieve("c")


def test_a_request_naming_an_adapter_runs_through_it(lora_engine: AsyncLLMEngine, client: openai.OpenAI) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def engine_text(lora: str | None) -> str:
        return (await lora_engine.generate(PROMPT, params, lora=lora)).text

    expected = {name: asyncio.run(engine_text(name)) for name in ("a", "b", None)}
    assert len(set(expected.values())) == 3
    for model, lora in (("a", "a"), ("b", "b"), ("tiny", None)):
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.model == model and r.choices[0].text == expected[lora]
    streamed = client.completions.create(
        model="a", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected["a"]
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "b" and chat.usage is not None and chat.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError, match="The model `zzz` does not exist; this server serves `tiny`, `a`"):
        client.completions.create(model="zzz", prompt=PROMPT, max_tokens=2)


def test_lora_modules_flag_parses_and_checks() -> None:
    parser = build_parser()
    args = parser.parse_args(["m", "--lora-modules", "x=/a", "y=/b", "--lora-modules", "z=/c"])
    engine_args: dict[str, object] = {}
    assert lora_modules(args, engine_args) == {"x": "/a", "y": "/b", "z": "/c"}
    assert engine_args == {"enable_lora": True}
    with pytest.raises(InvalidConfigError, match="drop --no-enable-lora"):
        lora_modules(args, {"enable_lora": False})
    with pytest.raises(InvalidConfigError, match="names an adapter 'm', the model's own served name"):
        lora_modules(parser.parse_args(["m", "--lora-modules", "m=/a"]), {})
    with pytest.raises(InvalidConfigError, match="names an adapter twice"):
        lora_modules(parser.parse_args(["m", "--lora-modules", "x=/a", "x=/b"]), {})
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--lora-modules", "nopath"])


def test_a_bad_lora_module_fails_in_one_line(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "serve",
        str(tiny_model),
        "--device",
        "cpu",
        "--num-kv-blocks",
        "64",
        "--log-level",
        "warning",
        "--no-core-process",
    ]
    assert main([*argv, "--port", str(free_port()), "--lora-modules", f"x={tiny_model}"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "asyncllm: cannot add LoRA adapter 'x': no LoRA adapter at" in err, err


@pytest.mark.slow
def test_serve_lora_modules_from_the_command_line(tiny_model: Path, tiny_lora_adapters) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(tiny_model), "--port", str(port), "--device", "cpu"]
    cmd += ["--num-kv-blocks", "64", "--block-size", "4", "--max-lora-rank", "8"]
    cmd += ["--lora-modules", f"a={tiny_lora_adapters['a']}", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == [tiny_model.name, "a"]
            assert client.completions.create(model="a", prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "LoRA: 4 adapter slots, max_lora_rank 8" in err, err  # the banner
    assert f'LoRA adapter a from {tiny_lora_adapters["a"]}: clients send "model": "a"' in err, err
