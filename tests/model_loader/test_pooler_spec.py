"""Task resolution and the pooler read from a checkpoint (model_loader/pooler_spec.py and
sentence_transformers.py): what task=None becomes for each kind of checkpoint, the sentence-transformers
files' pooling, Normalize and prompts, and the clear refusals (a task the checkpoint cannot serve, a module
or pooling mode asyncllm does not compute)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncllm.config_values import Task
from asyncllm.errors import InvalidConfigError, UnsupportedModelError
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.model_loader.pooler_spec import resolve_pooler
from asyncllm.model_loader.sentence_transformers import read_sentence_transformers
from asyncllm.models.config import ModelArchConfig
from asyncllm.pooling import PoolerSpec, PoolingMethod, ScoreMethod
from tests.fixtures.pooling_models import (
    QUERY_PROMPT,
    add_sentence_transformers,
    build_qwen3_embedding,
    build_qwen3_reranker,
)
from tests.fixtures.tiny_encoders import build_bert_checkpoint
from tests.fixtures.tiny_models import build_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooler_spec")
    return {
        "embedding": build_qwen3_embedding(root / "embedding"),
        "reranker": build_qwen3_reranker(root / "reranker"),
        "qwen3": build_checkpoint(root / "qwen3", "qwen3"),
        "llama": build_checkpoint(root / "llama", "llama"),
        "bert": build_bert_checkpoint(root / "bert", "BertModel"),
        "cross": build_bert_checkpoint(root / "cross", "BertForSequenceClassification"),
        "two_labels": build_bert_checkpoint(root / "two_labels", "BertForSequenceClassification", num_labels=2),
    }


def _spec(path: Path, task: Task | None = None) -> PoolerSpec | None:
    checkpoint = open_checkpoint(str(path), torch.float32)
    return resolve_pooler(task, checkpoint, ModelArchConfig.from_hf(checkpoint.hf_config, None))


def test_task_none_resolves_from_the_checkpoint(ckpts: dict[str, Path]) -> None:
    embedding = _spec(ckpts["embedding"])
    assert embedding is not None and embedding.task is Task.EMBED
    assert embedding.method is PoolingMethod.LAST and embedding.normalizes and embedding.hidden_size == 64
    assert embedding.prompts == {"query": QUERY_PROMPT, "document": ""} and embedding.default_prompt_name is None
    bert = _spec(ckpts["bert"])
    assert bert is not None and bert.task is Task.EMBED and bert.method is PoolingMethod.CLS and bert.encoder
    cross = _spec(ckpts["cross"])
    assert cross is not None and cross.task is Task.SCORE and cross.score is ScoreMethod.CLASSIFIER
    assert _spec(ckpts["qwen3"]) is None and _spec(ckpts["reranker"]) is None  # plain decoders generate


def test_a_decoder_embeds_by_its_last_token_and_a_qwen3_scores_yes_or_no(ckpts: dict[str, Path]) -> None:
    embed = _spec(ckpts["llama"], Task.EMBED)
    assert embed is not None and embed.method is PoolingMethod.LAST and not embed.normalizes and not embed.encoder
    reranker = _spec(ckpts["reranker"], Task.SCORE)
    assert reranker is not None and reranker.score is ScoreMethod.YES_NO and reranker.yes_no_token_ids is not None
    vocab = open_checkpoint(str(ckpts["reranker"]), torch.float32).tokenizer.get_vocab()
    assert reranker.yes_no_token_ids == (vocab["no"], vocab["yes"])


def test_tasks_a_checkpoint_cannot_serve_are_refused_by_name(ckpts: dict[str, Path]) -> None:
    with pytest.raises(InvalidConfigError, match="task='score' cannot be served by LlamaForCausalLM"):
        _spec(ckpts["llama"], Task.SCORE)
    with pytest.raises(InvalidConfigError, match="task='generate' cannot be served by BertModel: it is an encoder"):
        _spec(ckpts["bert"], Task.GENERATE)
    with pytest.raises(UnsupportedModelError, match="2 labels"):
        _spec(ckpts["two_labels"], Task.SCORE)
    with pytest.raises(UnsupportedModelError, match="the tokenizer has no 'no' token"):
        _spec(ckpts["qwen3"], Task.SCORE)  # its tokenizer has no "yes" to read


def test_mean_pooling_of_a_sentence_transformers_bert(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "minilm"
    shutil.copytree(ckpts["bert"], path)
    add_sentence_transformers(path, "mean", normalize=True, hidden_size=32, default_prompt_name=None)
    spec = _spec(path)
    assert spec is not None and spec.method is PoolingMethod.MEAN and spec.normalizes and spec.encoder


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: _pooling(d, pooling_mode_max_tokens=True), "sets pooling_mode_max_tokens"),
        (lambda d: _pooling(d, pooling_mode_mean_tokens=True), "exactly one of"),  # two modes
        (lambda d: _pooling(d, pooling_mode_lasttoken=False), "exactly one of"),  # none
        (lambda d: _modules(d, "sentence_transformers.models.Dense"), "Dense"),
        (lambda d: _st(d, prompts=["query"]), "prompts must map names to texts"),
        (lambda d: _st(d, default_prompt_name="passage"), "default_prompt_name='passage' is not one of"),
    ],
)
def test_sentence_transformers_files_asyncllm_does_not_compute_are_refused(
    ckpts: dict[str, Path], tmp_path: Path, edit: object, message: str
) -> None:
    path = tmp_path / "st"
    path.mkdir()
    add_sentence_transformers(path, "lasttoken", prompts={"query": "q: "})
    edit(path)  # type: ignore[operator]
    with pytest.raises(UnsupportedModelError, match=message):
        read_sentence_transformers(path)


def test_mean_pooling_without_the_prompt_is_refused(tmp_path: Path) -> None:
    add_sentence_transformers(tmp_path, "mean")
    _pooling(tmp_path, include_prompt=False)
    with pytest.raises(UnsupportedModelError, match="include_prompt=false"):
        read_sentence_transformers(tmp_path)
    assert read_sentence_transformers(tmp_path / "absent") is None


def _pooling(path: Path, **changes: object) -> None:
    config = path / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


def _modules(path: Path, kind: str) -> None:
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 9, "name": "9", "path": "9_Dense", "type": kind})
    (path / "modules.json").write_text(json.dumps(modules))


def _st(path: Path, **changes: object) -> None:
    config = path / "config_sentence_transformers.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))
