"""Embed and score engines on the GPU (skipped without CUDA): the Triton paths (the paged prefill with its
one-layer cache for a Qwen3-Embedding, the varlen kernel for BERT) against their torch twins on the same card
and against transformers, in bfloat16; a batch of mixed lengths against each input alone; the Qwen3-Reranker's
P(yes) and a cross-encoder's score twin to twin."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from asyncllm import LLM
from tests.fixtures.pooling_models import add_sentence_transformers, build_qwen3_embedding, build_qwen3_reranker
from tests.fixtures.tiny_encoders import build_bert_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ARGS: dict[str, Any] = dict(device="cuda", dtype="bfloat16", block_size=16)
BF16_COSINE = 0.999  # bfloat16 keeps 8 bits of mantissa: unit vectors agree to about this


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling_gpu")
    bert = build_bert_checkpoint(root / "bert", "BertModel", max_position_embeddings=512)
    minilm = root / "minilm"
    shutil.copytree(bert, minilm)
    add_sentence_transformers(minilm, "mean", normalize=True, hidden_size=32)
    return {
        "embedding": build_qwen3_embedding(root / "embedding"),
        "reranker": build_qwen3_reranker(root / "reranker"),
        "minilm": minilm,
        "cross": build_bert_checkpoint(root / "cross", "BertForSequenceClassification"),
    }


@pytest.fixture(scope="module")
def inputs() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (1, 7, 300, 129, 64, 17, 511, 2)]


def _twins(path: Path, **kwargs: Any) -> Iterator[LLM]:
    for backend in ("triton", "torch"):
        llm = LLM(str(path), attention_backend=backend, **ARGS, **kwargs)
        try:
            yield llm
        finally:
            llm.shutdown()


def _cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return F.cosine_similarity(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)).tolist()


def test_qwen3_embedding_triton_equals_its_twin_and_transformers(paths: dict[str, Path], inputs: Any) -> None:
    got = []
    for llm in _twins(paths["embedding"]):
        assert llm.runtime.attention_backend in ("triton", "torch") and llm.runtime.kv_cache_bytes > 0
        got.append([e.embedding for e in llm.embed(inputs)])
        alone = [llm.embed(x)[0].embedding for x in inputs]
        assert min(_cosines(got[-1], alone)) >= BF16_COSINE  # batched as they came == one at a time
    assert min(_cosines(got[0], got[1])) >= BF16_COSINE
    model = transformers.Qwen3Model.from_pretrained(paths["embedding"], dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        want = [F.normalize(model(torch.tensor([x]).cuda()).last_hidden_state[0, -1], dim=0).tolist() for x in inputs]
    assert min(_cosines(got[0], want)) >= 0.99


def test_bert_mean_pooling_through_the_varlen_kernel_equals_its_twin(paths: dict[str, Path]) -> None:
    texts = ["hello world", "the cat sat on the mat " * 20, "paris", "query document " * 60]
    got = [[e.embedding for e in llm.embed(texts)] for llm in _twins(paths["minilm"])]
    assert min(_cosines(got[0], got[1])) >= BF16_COSINE


def test_scores_triton_against_torch(paths: dict[str, Path]) -> None:
    docs = ["paris is the capital of france", "the cat sat on the mat", "hello"]
    for name, task in (("reranker", "score"), ("cross", None)):
        scores = [llm.score("the capital", docs) for llm in _twins(paths[name], task=task)]
        assert max(abs(a - b) for a, b in zip(*scores)) < 2e-2, name
