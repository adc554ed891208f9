"""The pooling maths (layers/pooler.py) against a plain per-sequence spelling of sentence-transformers'
Pooling and Normalize modules and of the Qwen3-Reranker's yes/no score, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm.layers.pooler import classifier_scores, finish_embeddings, pool, yes_no_scores
from asyncllm.pooling import PoolingMethod, PoolingParams


def _per_sequence(hidden: torch.Tensor, lens: list[int], method: PoolingMethod) -> torch.Tensor:
    rows, start = [], 0
    for n in lens:
        seq = hidden[start : start + n].double()
        rows.append({PoolingMethod.LAST: seq[-1], PoolingMethod.CLS: seq[0], PoolingMethod.MEAN: seq.mean(0)}[method])
        start += n
    return torch.stack(rows)


@pytest.mark.parametrize("method", list(PoolingMethod))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_equals_each_sequence_pooled_alone(method: PoolingMethod, dtype: torch.dtype) -> None:
    lens = [1, 7, 3, 12, 1, 5]
    hidden = torch.randn(sum(lens), 24).to(dtype)
    got = pool(hidden, lens, method)
    assert got.dtype == torch.float32 and got.shape == (len(lens), 24)
    torch.testing.assert_close(got.double(), _per_sequence(hidden, lens, method), rtol=1e-6, atol=1e-6)


def test_embeddings_follow_the_models_normalize_then_the_matryoshka_cut() -> None:
    pooled = torch.randn(5, 16) * 3
    params = [
        PoolingParams(),  # normalised whole
        PoolingParams(dimensions=4),  # the first 4, renormalised
        PoolingParams(dimensions=4, normalize=False),  # the first 4 as they are
        PoolingParams(normalize=False),
        PoolingParams(dimensions=16),
    ]
    out = finish_embeddings(pooled, False, params)
    torch.testing.assert_close(out[0], F.normalize(pooled[0], dim=0))
    torch.testing.assert_close(out[1, :4], F.normalize(pooled[1, :4], dim=0))
    torch.testing.assert_close(out[2, :4], pooled[2, :4])
    torch.testing.assert_close(out[3], pooled[3])
    torch.testing.assert_close(out[4], F.normalize(pooled[4], dim=0))
    # A checkpoint with a Normalize module: every vector leaves it normalised, before any cut
    modules = finish_embeddings(pooled, True, params)
    torch.testing.assert_close(modules[3], F.normalize(pooled[3], dim=0))
    torch.testing.assert_close(modules[2, :4], F.normalize(pooled[2], dim=0)[:4])  # cut after it, not renormalised
    torch.testing.assert_close(modules[1, :4], F.normalize(pooled[1, :4], dim=0))
    assert torch.equal(pooled, pooled.clone())  # the input is left alone


def test_yes_no_score_is_the_softmax_over_the_two_answers() -> None:
    logits = torch.randn(4, 50) * 4
    no, yes = 7, 31
    want = torch.softmax(logits[:, [no, yes]].double(), dim=1)[:, 1]
    torch.testing.assert_close(yes_no_scores(logits, no, yes).double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(classifier_scores(logits[:, :1]), torch.sigmoid(logits[:, 0]))
