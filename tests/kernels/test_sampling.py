"""The one-launch seeded Gumbel-max draw (kernels/sampling.py) against its torch twin (sampling_ref.py).

Same noise bits, so the same tokens: greedy rows (temperature 0) take the first maximum, random rows the
argmax of logits / T plus the hashed noise. Odd vocabulary sizes (tile edges), strided rows, huge and
negative seeds, large offsets; float32 through the interpreter on CPU, bf16/fp32 on CUDA up to a real
vocabulary. The twin's draws follow softmax(logits / T) (chi-square over many seeds and over many offsets).
"""

from __future__ import annotations

import pytest
import torch
from asyncllm.kernels.sampling_ref import gumbel_argmax_ref, uniform_noise_ref

from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, import_kernel


@pytest.fixture(scope="module")
def kernel():
    return import_kernel("sampling")


def _case(rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32, stride_pad: int = 0):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, vocab + stride_pad, generator=gen) * 3
    logits = full.to(dtype).to(DEVICE)[:, :vocab]  # rows strided when stride_pad > 0
    temperature = torch.rand(rows, generator=gen) * 2
    temperature[::3] = 0.0  # every third row greedy
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    seeds[0] = 2**63 - 1
    offsets = torch.randint(0, 2**32, (rows,), generator=gen)
    return logits, temperature.to(DEVICE), seeds.to(DEVICE), offsets.to(DEVICE)


def _assert_same_choice(got: torch.Tensor, logits, temperature, seeds, offsets) -> None:
    want = gumbel_argmax_ref(logits, temperature, seeds, offsets)
    if torch.equal(got.cpu(), want.cpu()):
        return
    # Only an ulp of log may move a near-tie: the kernel's choice must score within 1e-5 of the best.
    x = logits.float()
    noise = -torch.log(-torch.log(uniform_noise_ref(seeds, offsets, x.shape[1])))
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature)[:, None]
    score = torch.where((temperature == 0)[:, None], x, x / t + noise)
    picked = score.gather(1, got.view(-1, 1))[:, 0]
    assert (score.max(dim=1).values - picked).abs().max().item() < 1e-5


@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (5, 1000), (3, 1024), (4, 2049), (2, 384)])
def test_kernel_matches_twin(kernel, rows: int, vocab: int) -> None:
    case = _case(rows, vocab, seed=rows * vocab, stride_pad=3 if rows > 2 else 0)
    got = kernel.gumbel_argmax(*case)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    _assert_same_choice(got, *case)
    greedy = case[1] == 0
    assert torch.equal(got[greedy].cpu(), case[0].float().argmax(dim=-1)[greedy].cpu())


def test_ties_take_the_first_column(kernel) -> None:
    logits = torch.zeros(2, 3000, device=DEVICE)
    logits[:, [5, 1700, 2999]] = 4.0
    zeros = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    assert kernel.gumbel_argmax(logits, torch.zeros(2, device=DEVICE), zeros, zeros).tolist() == [5, 5]


def test_bad_inputs_are_named(kernel) -> None:
    logits, temperature, seeds, offsets = _case(3, 64, seed=1)
    with pytest.raises(ValueError, match="seeds must be contiguous"):
        kernel.gumbel_argmax(logits, temperature, torch.stack([seeds, seeds], 1)[:, 0], offsets)
    with pytest.raises(ValueError, match="temperature"):
        kernel.gumbel_argmax(logits, temperature.double(), seeds, offsets)
    with pytest.raises(TypeError, match="dtype"):
        kernel.gumbel_argmax(logits.double(), temperature, seeds, offsets)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 8, 48, 256])
def test_kernel_matches_twin_on_cuda_at_real_vocab(kernel, dtype: torch.dtype, rows: int) -> None:
    case = _case(rows, 151_936, seed=rows, dtype=dtype)
    _assert_same_choice(kernel.gumbel_argmax(*case), *case)


@pytest.mark.parametrize("vary", ["seed", "offset"])
def test_twin_draws_follow_the_softmax(vary: str) -> None:
    vocab, draws, temperature = 40, 60_000, 0.7
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    n = torch.arange(draws, dtype=torch.int64)
    seeds = n * 7919 + 11 if vary == "seed" else torch.full((draws,), 42)
    offsets = torch.zeros(draws, dtype=torch.int64) if vary == "seed" else n
    tokens = gumbel_argmax_ref(row.expand(draws, -1), torch.full((draws,), temperature), seeds, offsets)
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = (row.double() / temperature).softmax(0) * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 3 * (vocab - 1) + 25  # mean 39, sd ~9 for the right distribution


def test_noise_is_uniform_in_the_open_interval() -> None:
    u = uniform_noise_ref(torch.tensor([0, -1, 2**63 - 1]), torch.tensor([0, 2**32 - 1, 5]), 100_000)
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_any_split_of_the_vocabulary_gives_the_same_tokens(kernel, num_splits: int) -> None:
    """The vocabulary split across programs (then reduced) changes nothing, ties across splits included."""
    logits, temperature, seeds, offsets = _case(4, 5000, seed=num_splits)
    logits[1, [1500, 4500]] = 100.0  # a greedy row's tie across splits: the first column wins
    temperature[1] = 0.0
    got = kernel.gumbel_argmax(logits, temperature, seeds, offsets, num_splits=num_splits)
    _assert_same_choice(got, logits, temperature, seeds, offsets)
    assert got[1].item() == 1500
