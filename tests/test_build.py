"""The composition root's tokenizer wiring: the batch encoder the tokenizer thread uses (the Rust call that
releases the GIL) gives the same ids as the tokenizer's own call, special tokens included, for a Hugging
Face checkpoint and for the built-in GGUF model."""

from __future__ import annotations

import time

import pytest

from asyncllm.build import build_engine
from asyncllm.config import EngineConfig
from tests.fixtures.default_model import smollm2_path

TEXTS = ["Hello world!", "日本語のテキスト 😀", "  leading spaces\n\nand lines", "café naïve", "a"]


@pytest.mark.parametrize("which", ["hf", "gguf"])
@pytest.mark.slow
def test_batch_encoding_equals_the_tokenizers_own(which: str, tiny_model) -> None:
    path = str(tiny_model) if which == "hf" else str(smollm2_path())
    built = build_engine(EngineConfig.from_kwargs(path, device="cpu", num_kv_blocks=16), time.monotonic)
    try:
        assert built.tokenizer is not None
        want = [list(built.tokenizer(t).input_ids) for t in TEXTS]
        assert built.encode_batch is not None and built.encode is not None
        assert built.encode_batch(TEXTS) == want == [built.encode(t) for t in TEXTS]
        assert built.encode_batch(TEXTS[:1]) == want[:1]
    finally:
        built.core.shutdown()
