"""The CPU engine's draw (kernels/sampling_cpu.py) against its specification, `gumbel_argmax_ref`: the same
tokens, exactly, for greedy, sampled and mixed batches, rows wider than one block of columns, huge and
negative seeds and offsets, extreme temperatures, NaN and infinite logits, and token bitmasks."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.sampling_cpu import gumbel_argmax_cpu
from asyncllm.kernels.sampling_ref import gumbel_argmax_ref


def _case(rows: int, vocab: int, seed: int, greedy_every: int = 3) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab + 3, generator=gen)[:, :vocab] * 4  # strided rows
    temperature = torch.rand(rows, generator=gen) * 2 + 0.05
    if greedy_every:
        temperature[::greedy_every] = 0.0
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
    seeds[0] = 2**63 - 1
    offsets = torch.randint(0, 2**40, (rows,), generator=gen)  # past 2**32: only the low 32 bits count
    return logits, temperature, seeds, offsets


@pytest.mark.parametrize(
    ("rows", "vocab"), [(1, 1), (1, 7), (2, 31), (1, 49152), (5, 1000), (17, 4099), (64, 5003), (1, 151936)]
)
@pytest.mark.parametrize("greedy_every", [0, 3])
def test_tokens_equal_the_reference(rows: int, vocab: int, greedy_every: int) -> None:
    case = _case(rows, vocab, seed=rows * 7919 + vocab, greedy_every=greedy_every)
    got = gumbel_argmax_cpu(*case)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, gumbel_argmax_ref(*case))


def test_many_draws_of_one_row_equal_the_reference() -> None:
    """One real-vocabulary row drawn at 48 offsets: every token the reference's."""
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(0)).expand(48, -1) * 3
    temperature, seeds = torch.full((48,), 0.8), torch.full((48,), 1234)
    offsets = torch.arange(48)
    got = gumbel_argmax_cpu(logits, temperature, seeds, offsets)
    assert torch.equal(got, gumbel_argmax_ref(logits, temperature, seeds, offsets))
    assert len(set(got.tolist())) > 10  # really random


def test_extreme_temperatures_and_special_values() -> None:
    logits, temperature, seeds, offsets = _case(8, 40000, seed=5, greedy_every=0)  # two blocks of columns
    temperature[0], temperature[1] = 1e-30, 1e30  # scores overflow to inf / noise dominates
    logits[2] = float("-inf")  # nothing possible: token 0
    logits[3, 25000:] = float("-inf")
    logits[4, 100] = float("nan")  # NaN wins the argmax, as in the reference
    logits[5, [39000, 7]] = float("inf")  # the first infinite column wins, in the first block
    logits[6] = 0.0
    logits[7, 35000] = float("nan")  # a NaN in the second block
    got = gumbel_argmax_cpu(logits, temperature, seeds, offsets)
    assert torch.equal(got, gumbel_argmax_ref(logits, temperature, seeds, offsets))
    assert got[2] == 0 and got[4] == 100 and got[5] == 7 and got[7] == 35000


def test_bitmask_rows_equal_the_reference() -> None:
    rows, vocab = 6, 2000
    logits, temperature, seeds, offsets = _case(rows, vocab, seed=11)
    gen = torch.Generator().manual_seed(3)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words + 1), generator=gen, dtype=torch.int32)
    mask_rows = torch.tensor([0, -1, 1, 2, -1, 0], dtype=torch.int32)
    got = gumbel_argmax_cpu(logits, temperature, seeds, offsets, bitmask, mask_rows)
    assert torch.equal(got, gumbel_argmax_ref(logits, temperature, seeds, offsets, bitmask, mask_rows))
    with pytest.raises(ValueError, match="go together"):
        gumbel_argmax_cpu(logits, temperature, seeds, offsets, bitmask, None)


def test_bf16_logits_equal_the_reference() -> None:
    logits, temperature, seeds, offsets = _case(4, 777, seed=2)
    logits = logits.to(torch.bfloat16)
    assert torch.equal(
        gumbel_argmax_cpu(logits, temperature, seeds, offsets), gumbel_argmax_ref(logits, temperature, seeds, offsets)
    )
