"""A tokenizer path the user gives must exist and hold a tokenizer; the checkpoint's own stays optional; a
tensor-parallel worker's reopened checkpoint loads the same one, only when asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.errors import ModelNotFoundError, UnsupportedModelError
from asyncllm.model_loader.checkpoint import open_checkpoint, reopen_checkpoint
from tests.fixtures.tiny_models import build_checkpoint, build_tokenizer, linked_checkpoint


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


def test_a_reopened_checkpoint_loads_rank_0s_tokenizer_only_when_asked(checkpoint_dir: Path, tmp_path: Path) -> None:
    """A tensor-parallel worker reopens rank 0's checkpoint (`reopen_checkpoint`): the same weights and rank 0's
    EOS ids, no config parsed and no tokenizer loaded; `load_tokenizer` loads the one rank 0 has (the given one,
    else the checkpoint's own), and a directory without one has none to load."""
    from tests.fixtures.tiny_gguf import build_hf_model, write_gguf

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    build_tokenizer(tok_dir)
    bare = linked_checkpoint(checkpoint_dir, tmp_path / "bare", drop=("tokenizer",))
    gguf_path = write_gguf(tmp_path / "m.gguf", "llama", build_hf_model("llama"))
    for model, given in [(checkpoint_dir, None), (checkpoint_dir, tok_dir), (gguf_path, tok_dir), (bare, None)]:
        given_path = None if given is None else str(given)
        opened = open_checkpoint(str(model), torch.float32, given_path)
        reopened = reopen_checkpoint(str(model), torch.float32, given_path, frozenset({5}))
        assert reopened.tokenizer is None and reopened.eos_token_ids == {5}
        assert model.suffix == ".gguf" or reopened.hf_config is None
        got, want = dict(reopened.iter_weights()), dict(opened.iter_weights())
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        if opened.tokenizer is None:
            assert reopened.load_tokenizer is None, model
            continue
        assert reopened.load_tokenizer is not None
        loaded = reopened.load_tokenizer()
        assert Path(loaded.name_or_path) == Path(opened.tokenizer.name_or_path) == (given or model)
        assert loaded.get_vocab() == opened.tokenizer.get_vocab()


def test_a_background_tokenizer_is_the_same_one_and_its_failure_is_raised(checkpoint_dir: Path, tmp_path: Path) -> None:
    """`background_tokenizer=True` (the engine's build: the tokenizer loads beside the weights): the same
    tokenizer (the given one, else the checkpoint's own) once `loaded_tokenizer()` waits for it; a given path
    is still checked at once; a tokenizer file that cannot load raises an error naming the directory from
    `loaded_tokenizer()`; a directory without one has none."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    build_tokenizer(tok_dir)
    text = "Paris is the capital of France."
    for given in (None, str(tok_dir)):
        eager = open_checkpoint(str(checkpoint_dir), torch.float32, given).tokenizer
        background = open_checkpoint(str(checkpoint_dir), torch.float32, given, background_tokenizer=True)
        assert background.tokenizer is None and background.load_tokenizer is not None
        loaded = background.loaded_tokenizer()
        assert loaded is background.tokenizer and background.load_tokenizer is None
        assert loaded.name_or_path == eager.name_or_path and loaded(text).input_ids == eager(text).input_ids
    with pytest.raises(ModelNotFoundError, match=r"tokenizer='/nonexistent' is not a directory"):
        open_checkpoint(str(checkpoint_dir), torch.float32, "/nonexistent", background_tokenizer=True)
    broken = linked_checkpoint(checkpoint_dir, tmp_path / "broken", tokenizer__json="{ not json")
    opened = open_checkpoint(str(broken), torch.float32, background_tokenizer=True)
    with pytest.raises(UnsupportedModelError, match=f"the tokenizer in {broken} could not be loaded: Expecting"):
        opened.loaded_tokenizer()
    bare = linked_checkpoint(checkpoint_dir, tmp_path / "bare", drop=("tokenizer",))
    none = open_checkpoint(str(bare), torch.float32, background_tokenizer=True)
    assert none.load_tokenizer is None and none.loaded_tokenizer() is None  # nothing deferred: no grammar backend
