"""The one-launch seeded Gumbel-max draw (kernels/sampling.py) against its torch twin (sampling_ref.py).

Same noise bits, so the same tokens: greedy rows (temperature 0) take the first maximum, random rows the
argmax of logits / T plus the hashed noise. Odd vocabulary sizes (tile edges), strided rows, huge and
negative seeds, large offsets; float32 through the interpreter on CPU, bf16/fp32 on CUDA up to a real
vocabulary. The twin's draws follow softmax(logits / T) (chi-square over many seeds and over many offsets).
Token bitmasks (xgrammar's layout, packed here independently of the twin): random densities, mixed
constrained and free rows, every row count the other kernel tests use; disallowed tokens are never drawn.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.sampling_ref import apply_token_bitmask_ref, gumbel_argmax_ref, uniform_noise_ref
from tests.fixtures.triton_kernels import CPU_TOKENS, DEVICE, GPU_TOKENS, HAS_CUDA, import_kernel


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


def test_the_extreme_hashes_map_strictly_inside_the_unit_interval() -> None:
    """Regression: u = ((h >> 8) + 0.5) * 2**-24 rounded to exactly 1.0 in float32 for the top hash value, so
    that column's noise was +inf and it won whatever its logit (~1 % of draws over a 150k vocabulary; NaN
    where a bitmask had set the logit to -inf). Every 23-bit value now maps inside (0, 1) and noise is finite,
    the twin's draws included: seed 2 at offset 2 hashes one of its 151,936 columns to the top value."""
    top = torch.tensor([0xFFFFFFFF, 0xFFFFFE00, 0x000001FF, 0], dtype=torch.int64)
    u = ((top >> 9).to(torch.float32) + 0.5) * 2.0**-23  # the expression uniform_noise_ref and the kernel use
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    # One row holding the top hash, not a sweep of millions hoping to meet it: its largest draw is the float
    # just below 1 (the old 24-bit map rounded this very draw up to 1.0).
    row = uniform_noise_ref(torch.tensor([2]), torch.tensor([2]), 151_936)
    assert row.max().item() == 1 - 2.0**-24 and torch.isfinite(-torch.log(-torch.log(row))).all()


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_any_split_of_the_vocabulary_gives_the_same_tokens(kernel, num_splits: int) -> None:
    """The vocabulary split across programs (then reduced) changes nothing, ties across splits included."""
    logits, temperature, seeds, offsets = _case(4, 5000, seed=num_splits)
    logits[1, [1500, 4500]] = 100.0  # a greedy row's tie across splits: the first column wins
    temperature[1] = 0.0
    got = kernel.gumbel_argmax(logits, temperature, seeds, offsets, num_splits=num_splits)
    _assert_same_choice(got, logits, temperature, seeds, offsets)
    assert got[1].item() == 1500


# --- Token bitmasks (structured output): xgrammar's int32 layout, bit t % 32 of word t // 32 = token t allowed.

TOKENS = GPU_TOKENS if HAS_CUDA else CPU_TOKENS
# Vocabularies that are not multiples of 32 (a partial last word) nor of the 1024-column tile.
MASK_VOCABS = [2049, 1000, 333, 77]


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """[M, 32 * W] bool -> [M, W] int32 words, bit j of word w = bits[:, 32 * w + j] (xgrammar's layout)."""
    words = (bits.view(bits.shape[0], -1, 32).long() << torch.arange(32)).sum(-1)  # [M, W] in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _bitmask(num_masks: int, vocab: int, gen: torch.Generator, extra_words: int = 0, pad: int = 0):
    """(bitmask [M, W] int32 on DEVICE, rows strided by `pad` words; allowed [M, 32 * W] bool on CPU).
    Row 0 allows one token (in the last, partial word), row 1 everything, the rest a random density each;
    the bits past the vocabulary are random too (they must be ignored)."""
    words = -(-vocab // 32) + extra_words
    density = torch.rand(num_masks, 1, generator=gen)
    allowed = torch.rand(num_masks, 32 * words, generator=gen) < density
    allowed[0] = torch.rand(32 * words, generator=gen) < 0.5
    allowed[0, :vocab] = False
    allowed[0, vocab - 1 - int(torch.randint(0, 1 + (vocab - 1) % 32, (1,), generator=gen))] = True
    if num_masks > 1:
        allowed[1] = True
    full = torch.randint(-(2**31), 2**31 - 1, (num_masks, words + pad), generator=gen, dtype=torch.int32)
    full[:, :words] = _pack(allowed)
    return full.to(DEVICE)[:, :words], allowed


def _mask_rows(rows: int, num_masks: int, gen: torch.Generator, dtype: torch.dtype = torch.int64):
    """[R] bitmask rows on DEVICE: a random mix of -1 (unconstrained) and rows, both present from 2 rows on."""
    mask_rows = torch.randint(-1, num_masks, (rows,), generator=gen)
    mask_rows[0] = int(torch.randint(0, num_masks, (1,), generator=gen))
    if rows > 1:
        mask_rows[1] = -1
    return mask_rows.to(dtype).to(DEVICE)


def _allowed_rows(allowed: torch.Tensor, mask_rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool on CPU, gathered from the packed bits (independent of the twin's unpacking)."""
    rows = mask_rows.cpu().long()
    return torch.where((rows < 0)[:, None], True, allowed[rows.clamp(min=0), :vocab])


def _assert_same_masked_choice(got, logits, temperature, seeds, offsets, bitmask, mask_rows, allowed) -> None:
    """Every token allowed, greedy rows the masked argmax, the rest the twin's choice (up to a near-tie)."""
    ok = _allowed_rows(allowed, mask_rows, logits.shape[1])
    got = got.cpu()
    empty = ~ok.any(dim=1)  # rare with random densities: those rows must give token 0
    assert (ok.gather(1, got.view(-1, 1))[:, 0] | empty).all(), "a disallowed token was drawn"
    assert (got[empty] == 0).all()
    masked = logits.float().cpu().masked_fill(~ok, float("-inf"))
    greedy = (temperature == 0).cpu()
    assert torch.equal(got[greedy], masked.argmax(dim=-1)[greedy])
    want = gumbel_argmax_ref(logits, temperature, seeds, offsets, bitmask, mask_rows).cpu()
    differ = (got != want).to(DEVICE)  # never a row that allows nothing: both sides give token 0 there
    if differ.any():
        _assert_same_choice(
            got.to(DEVICE)[differ], masked.to(DEVICE)[differ], temperature[differ], seeds[differ], offsets[differ]
        )


@pytest.mark.parametrize("rows", TOKENS)
def test_masked_kernel_matches_twin(kernel, rows: int) -> None:
    """Random densities (one token, all, anything between), constrained and free rows, greedy and sampled
    rows, rows sharing a bitmask row, bitmask rows strided and wider than the vocabulary."""
    vocab = 4099 if HAS_CUDA else MASK_VOCABS[TOKENS.index(rows) % len(MASK_VOCABS)]
    gen = torch.Generator().manual_seed(1000 + rows)
    case = _case(rows, vocab, seed=7 * rows + vocab, stride_pad=5 if rows % 2 else 0)
    num_masks = 1 + int(torch.randint(0, rows + 2, (1,), generator=gen))
    bitmask, allowed = _bitmask(num_masks, vocab, gen, extra_words=rows % 3, pad=2 * (rows % 2))
    mask_rows = _mask_rows(rows, num_masks, gen, torch.int32 if rows % 2 else torch.int64)
    got = kernel.gumbel_argmax(*case, bitmask, mask_rows)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    _assert_same_masked_choice(got, *case, bitmask, mask_rows, allowed)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 8, 48, 256])
def test_masked_kernel_matches_twin_on_cuda_at_real_vocab(kernel, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    case = _case(rows, 151_936, seed=rows, dtype=dtype)
    bitmask, allowed = _bitmask(max(2, rows // 2), 151_936, gen)
    mask_rows = _mask_rows(rows, bitmask.shape[0], gen)
    got = kernel.gumbel_argmax(*case, bitmask, mask_rows)
    _assert_same_masked_choice(got, *case, bitmask, mask_rows, allowed)


def test_without_a_constraint_the_tokens_are_todays(kernel) -> None:
    """bitmask=None is today's launch; every row unconstrained, or every token allowed, draws the same."""
    case = _case(6, 1000, seed=5, stride_pad=3)
    today = kernel.gumbel_argmax(*case)
    assert torch.equal(kernel.gumbel_argmax(*case, bitmask=None, mask_rows=None), today)
    gen = torch.Generator().manual_seed(5)
    bitmask, _ = _bitmask(3, 1000, gen)
    free = torch.full((6,), -1, dtype=torch.int64, device=DEVICE)
    assert torch.equal(kernel.gumbel_argmax(*case, bitmask, free), today)
    everything = torch.full((6,), 1, dtype=torch.int64, device=DEVICE)  # _bitmask's row 1 allows all
    assert torch.equal(kernel.gumbel_argmax(*case, bitmask, everything), today)
    assert torch.equal(gumbel_argmax_ref(*case, bitmask, free), gumbel_argmax_ref(*case))


def test_masked_out_tokens_are_never_drawn(kernel) -> None:
    """The disallowed tokens hold the largest logits and the temperature is high: across many seeds (and
    greedy rows) only the allowed ones come out."""
    rows, vocab = 32, 100
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(vocab, generator=gen).expand(rows, -1).contiguous()
    ok = torch.zeros(vocab, dtype=torch.bool)
    ok[torch.randperm(vocab, generator=gen)[:3]] = True
    logits[:, ~ok] += 20.0
    bits = torch.zeros(1, 32 * 4, dtype=torch.bool)
    bits[0, :vocab] = ok
    temperature = torch.full((rows,), 8.0)
    temperature[::4] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    offsets = torch.randint(0, 2**32, (rows,), generator=gen)
    mask_rows = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    args = (logits.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE), offsets.to(DEVICE), _pack(bits).to(DEVICE))
    got = kernel.gumbel_argmax(*args, mask_rows).cpu()
    assert ok[got].all()
    assert len(set(got.tolist())) > 1  # the draw is still random among the allowed tokens


def test_a_row_that_allows_nothing_returns_token_zero(kernel) -> None:
    """No allowed token (a grammar error upstream): both sides return token 0, a valid index, no crash."""
    case = _case(3, 1000, seed=9)
    bitmask = torch.zeros(2, 32, dtype=torch.int32, device=DEVICE)
    bitmask[1] = -1
    mask_rows = torch.tensor([0, 1, 0], device=DEVICE)
    got = kernel.gumbel_argmax(*case, bitmask, mask_rows)
    assert torch.equal(got.cpu(), gumbel_argmax_ref(*case, bitmask, mask_rows).cpu())
    assert got[0].item() == got[2].item() == 0
    assert got[1].item() == kernel.gumbel_argmax(*case)[1].item()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_masked_splits_reduce_to_the_first_allowed_best(kernel, num_splits: int) -> None:
    """Allowed tokens only in the last split (the others score -inf everywhere); a greedy tie across splits
    whose first column is disallowed goes to the second."""
    vocab = 3000
    logits, temperature, seeds, offsets = _case(2, vocab, seed=num_splits)
    temperature[1] = 0.0
    logits[1, [100, 2500, 2900]] = 50.0
    bits = torch.ones(2, 32 * 94, dtype=torch.bool)
    bits[0, :2600] = False
    bits[1, 100] = False
    bitmask, mask_rows = _pack(bits).to(DEVICE), torch.tensor([0, 1], device=DEVICE)
    got = kernel.gumbel_argmax(logits, temperature, seeds, offsets, bitmask, mask_rows, num_splits=num_splits)
    assert got[0].item() >= 2600 and got[1].item() == 2500
    _assert_same_masked_choice(got, logits, temperature, seeds, offsets, bitmask, mask_rows, bits)


def test_bad_bitmasks_are_named(kernel) -> None:
    logits, temperature, seeds, offsets = _case(3, 100, seed=2)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 4), dtype=torch.int32, device=DEVICE)
    mask_rows = torch.tensor([0, -1, 1], device=DEVICE)
    bad = [
        ("go together", (bitmask, None)),
        ("int32", (bitmask.long(), mask_rows)),
        ("W >= 4", (bitmask[:, :3], mask_rows)),  # 3 words cover 96 < 100 tokens
        ("unit column stride", (torch.cat([bitmask, bitmask], 1)[:, ::2], mask_rows)),
        ("M >= 1", (bitmask[:0], mask_rows)),
        ("mask_rows must be", (bitmask, mask_rows[:2])),
        ("mask_rows must be", (bitmask, mask_rows.float())),
        ("mask_rows must be", (bitmask, torch.stack([mask_rows, mask_rows], 1)[:, 0])),
        (r"\[-1, 2\)", (bitmask, torch.tensor([0, 2, 1], device=DEVICE))),
        (r"\[-1, 2\)", (bitmask, torch.tensor([0, -2, 1], device=DEVICE))),
    ]
    for match, (bm, rows) in bad:
        for draw in (kernel.gumbel_argmax, gumbel_argmax_ref):
            if HAS_CUDA and match.startswith(r"\[-1"):
                continue  # on CUDA no value is checked (a sync a step): a row past M allows nothing
            with pytest.raises(ValueError, match=match):
                draw(logits, temperature, seeds, offsets, bm, rows)


def test_apply_token_bitmask_ref_writes_minus_inf_in_place() -> None:
    """Disallowed tokens of constrained rows become -inf; everything else is untouched (bits past the
    vocabulary ignored); the twin's draw with a bitmask is its draw on the masked logits."""
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 9, 333
    logits, temperature, seeds, offsets = _case(rows, vocab, seed=4)
    logits = logits.cpu().contiguous()
    bitmask, allowed = _bitmask(4, vocab, gen, extra_words=1, pad=3)
    bitmask = bitmask.cpu()
    mask_rows = _mask_rows(rows, 4, gen, torch.int32).cpu()
    masked = logits.clone()
    apply_token_bitmask_ref(masked, bitmask, mask_rows)
    ok = _allowed_rows(allowed, mask_rows, vocab)
    assert torch.equal(masked, logits.masked_fill(~ok, float("-inf")))
    args = (temperature.cpu(), seeds.cpu(), offsets.cpu())
    assert torch.equal(gumbel_argmax_ref(logits, *args, bitmask, mask_rows), gumbel_argmax_ref(masked, *args))


@pytest.mark.slow  # importing xgrammar takes seconds
def test_apply_token_bitmask_ref_agrees_with_xgrammar() -> None:
    """Our layout is xgrammar's: its own masking of the same logits gives the same -inf positions."""
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 1001, generator=gen)
    bitmask = xgr.allocate_token_bitmask(5, 1001)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int32))
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    apply_token_bitmask_ref(logits, bitmask, torch.arange(5))
    assert torch.equal(logits, want)


def test_twin_draws_follow_the_masked_softmax() -> None:
    """With a bitmask the draws follow softmax(logits / T) renormalised over the allowed tokens."""
    vocab, draws, temperature = 40, 30_000, 0.9
    gen = torch.Generator().manual_seed(6)
    row = torch.randn(vocab, generator=gen) * 1.5
    ok = torch.rand(32 * 2, generator=gen) < 0.5
    n = torch.arange(draws, dtype=torch.int64)
    tokens = gumbel_argmax_ref(
        row.expand(draws, -1), torch.full((draws,), temperature), n * 7919 + 3, torch.zeros(draws, dtype=torch.int64),
        _pack(ok[None]), torch.zeros(draws, dtype=torch.int64),
    )  # fmt: skip
    counts = torch.bincount(tokens, minlength=vocab).double()
    ok = ok[:vocab]
    assert counts[~ok].sum().item() == 0
    expected = (row.double() / temperature).masked_fill(~ok, float("-inf")).softmax(0)[ok] * draws
    chi_square = float(((counts[ok] - expected) ** 2 / expected).sum())
    k = int(ok.sum()) - 1
    assert chi_square < 3 * k + 25
