"""A tokenizer path the user gives must exist and hold a tokenizer; the checkpoint's own stays optional."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.errors import ModelNotFoundError
from asyncllm.model_loader.checkpoint import open_checkpoint
from tests.fixtures.tiny_models import build_checkpoint, build_tokenizer


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3")


def test_missing_tokenizer_path_fails_naming_it(checkpoint_dir: Path, tmp_path: Path) -> None:
    """Regression (issue 10, defect 6): `tokenizer="/nonexistent"` was silently ignored and the engine built
    with the checkpoint's tokenizer (or none). A path the user gave must exist and hold a tokenizer."""
    with pytest.raises(ModelNotFoundError, match=r"tokenizer='/nonexistent' is not a directory"):
        open_checkpoint(str(checkpoint_dir), torch.float32, "/nonexistent")
    with pytest.raises(ModelNotFoundError, match="holds no tokenizer"):
        open_checkpoint(str(checkpoint_dir), torch.float32, str(tmp_path))  # exists, but empty


def test_given_tokenizer_path_is_used(checkpoint_dir: Path, tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    given = open_checkpoint(str(checkpoint_dir), torch.float32, str(tmp_path)).tokenizer
    assert Path(given.name_or_path) == tmp_path
    own = open_checkpoint(str(checkpoint_dir), torch.float32).tokenizer
    assert Path(own.name_or_path) == checkpoint_dir


def test_gguf_uses_a_given_tokenizer_and_checks_it(tmp_path: Path) -> None:
    """Regression: a .gguf file ignored `tokenizer=` and always rebuilt the tokenizer its metadata describes
    (or none). A given path is used instead, and checked like a directory checkpoint's."""
    from tests.fixtures.tiny_gguf import build_hf_model, write_gguf

    gguf_path = write_gguf(tmp_path / "m.gguf", "llama", build_hf_model("llama"))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    build_tokenizer(tok_dir)
    given = open_checkpoint(str(gguf_path), torch.float32, str(tok_dir)).tokenizer
    assert Path(given.name_or_path) == tok_dir
    with pytest.raises(ModelNotFoundError, match=r"tokenizer='/nonexistent' is not a directory"):
        open_checkpoint(str(gguf_path), torch.float32, "/nonexistent")
