"""The tensor-parallel layers against their unsharded twins, with ranks as threads (tests/fixtures/thread_group):
the vocab-parallel embedding is exact and the LM head equal within rounding, also when the vocabulary does
not divide by the ranks (zero-padded last shard); the row-parallel linear adds its bias once; and every
rank ends with the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm.layers.embedding import LMHead, VocabEmbedding
from asyncllm.layers.linear import Linear
from asyncllm.layers.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, WeightShard
from asyncllm.models.tensor_parallel import local_vocab_size
from tests.fixtures.thread_group import ThreadGroup, run_ranks


def _vocab_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = local_vocab_size(full.shape[0], world)
    start = min(rank * rows, full.shape[0])
    return WeightShard(0, start, min(start + rows, full.shape[0]), rows).take(full)


@pytest.mark.parametrize(("vocab", "world"), [(8, 2), (7, 2), (11, 3), (5, 4)])
def test_vocab_parallel_embedding_and_head(vocab: int, world: int) -> None:
    weight = torch.randn(vocab, 6)
    ids = torch.randint(0, vocab, (13,))
    hidden = torch.randn(4, 6)

    def rank_fn(group: ThreadGroup) -> tuple[torch.Tensor, torch.Tensor]:
        local = _vocab_shard(weight, group.rank, world)
        embed = VocabEmbedding(local.shape[0], 6)
        head = LMHead(local.shape[0], 6)
        with torch.no_grad():
            embed.weight.copy_(local)
            head.weight.copy_(local)
        return VocabParallelEmbedding(embed, group)(ids), ParallelLMHead.from_head(head, vocab, group)(hidden)

    for got_embed, got_logits in run_ranks(world, rank_fn):
        assert torch.equal(got_embed, F.embedding(ids, weight))
        torch.testing.assert_close(got_logits, F.linear(hidden, weight))  # a GEMM per shard: rounding may differ
        assert got_logits.is_contiguous()


@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_linear_sums_partials_and_adds_bias_once(bias: bool) -> None:
    world, d_in, d_out = 2, 8, 5
    full = Linear(d_in, d_out, bias)
    with torch.no_grad():
        full.weight.normal_()
        if full.bias is not None:
            full.bias.normal_()
    x = torch.randn(3, d_in)

    def rank_fn(group: ThreadGroup) -> torch.Tensor:
        cols = slice(group.rank * d_in // world, (group.rank + 1) * d_in // world)
        local = Linear(d_in // world, d_out, bias)
        with torch.no_grad():
            local.weight.copy_(full.weight[:, cols])
            if local.bias is not None and full.bias is not None:
                local.bias.copy_(full.bias)
        return RowParallelLinear(local, group)(x[:, cols])

    outs = run_ranks(world, rank_fn)
    torch.testing.assert_close(outs[0], full(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[0], outs[1])  # replicated activations stay identical on every rank


def test_weight_shard_pads_the_last_vocabulary_rows_with_zeros() -> None:
    full = torch.arange(12.0).view(6, 2)
    shard = WeightShard(0, 4, 6, 3)
    assert torch.equal(shard.take(full), torch.tensor([[8.0, 9.0], [10.0, 11.0], [0.0, 0.0]]))
    assert torch.equal(WeightShard(1, 1, 2, 1).take(full), full[:, 1:2])
