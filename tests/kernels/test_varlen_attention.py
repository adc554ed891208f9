"""The Triton varlen attention kernel against `varlen_attention_ref`, its specification.

Ragged batches with a length-1 sequence and lengths around the tiles' edges (the float32 tiles are 64 query
rows by 32 keys), bidirectional and causal, GQA groups 1/2/4, head_dim 64 and 128 (and 24, 32 and 256: padded,
MiniLM's, the widest). q/k/v are strided views of one packed projection, as a model hands them over; the output is
NaN before each run, so an unwritten row fails. CPU runs use float32 in Triton's interpreter; 16-bit on GPU.
Fresh random inputs for every check.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.varlen_attention_ref import varlen_attention_ref
from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_kernel

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
BATCHES = [[1], [5, 1, 70, 33], [31, 32, 1, 65, 64]]


@pytest.fixture(scope="module")
def va():
    return import_kernel("varlen_attention")


def make_inputs(lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """q [T, H, D], k/v [T, Hkv, D] as views of one [T, (H + 2 Hkv) D] projection (strided rows), and cu_seqlens."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    total = sum(lens)
    qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=DEVICE).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    offsets = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    return (
        q.view(total, num_heads, head_dim),
        k.view(total, num_kv_heads, head_dim),
        v.view(total, num_kv_heads, head_dim),
        offsets.to(DEVICE),
    )


def check(va, lens: list[int], num_kv_heads: int, group: int, head_dim: int, causal: bool, dtype, seed: int) -> None:
    q, k, v, cu = make_inputs(lens, num_kv_heads * group, num_kv_heads, head_dim, dtype, seed)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    got = va.varlen_attention(q, k, v, cu, max(lens), scale, causal, out=out)
    assert got is out
    assert not out.isnan().any(), f"{out.isnan().any(-1).any(-1).sum().item()} rows were not written"
    ref = varlen_attention_ref(q, k, v, lens, scale, causal)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(2, 1, 64), (1, 4, 64), (2, 2, 128)])
def test_matches_ref(va, causal: bool, num_kv_heads: int, group: int, head_dim: int) -> None:
    for i, lens in enumerate(BATCHES):
        check(va, lens, num_kv_heads, group, head_dim, causal, torch.float32, seed=i + 10 * head_dim + causal)


@pytest.mark.parametrize("head_dim", [24, 32, 256])
def test_padded_small_and_wide_head_dims(va, head_dim: int) -> None:
    """24 pads to a 32-wide tile (masked dims); 32 is all-MiniLM-L6-v2's head; 256 the launcher's widest."""
    for causal in (False, True):
        check(va, [17, 1, 40], 3, 1, head_dim, causal, torch.float32, seed=head_dim + causal)


def test_sequences_do_not_see_each_other(va) -> None:
    """Changing one sequence's keys and values leaves every other sequence's output unchanged, bit for bit."""
    lens = [9, 20, 4]
    q, k, v, cu = make_inputs(lens, 2, 2, 64, torch.float32, seed=3)
    before = va.varlen_attention(q, k, v, cu, max(lens), 0.125, False)
    k2, v2 = k.clone(), v.clone()
    k2[9:29].normal_()
    v2[9:29].normal_()
    after = va.varlen_attention(q, k2, v2, cu, max(lens), 0.125, False)
    torch.testing.assert_close(after[:9], before[:9], atol=0, rtol=0)
    torch.testing.assert_close(after[29:], before[29:], atol=0, rtol=0)
    assert not torch.equal(after[9:29], before[9:29])


def test_launcher_rejects_bad_inputs(va) -> None:
    q, k, v, cu = make_inputs([3, 4], 4, 2, 64, torch.float32, seed=0)
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int32"):
        va.varlen_attention(q, k, v, cu.long(), 4, 0.125, False)
    with pytest.raises(ValueError, match="max_seqlen=0"):
        va.varlen_attention(q, k, v, cu, 0, 0.125, False)
    with pytest.raises(ValueError, match="do not fit q"):
        va.varlen_attention(q, k[:, :, :32], v[:, :, :32], cu, 4, 0.125, False)
    with pytest.raises(ValueError, match="Hkv dividing H"):
        va.varlen_attention(q[:, :3], k, v, cu, 4, 0.125, False)
    with pytest.raises(TypeError, match="share one of"):
        va.varlen_attention(q, k.double(), v.double(), cu, 4, 0.125, False)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        va.varlen_attention(torch.cat([q, q], dim=-1)[..., ::2], k, v, cu, 4, 0.125, False)
    wide = torch.zeros(7, 1, 512, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim=512"):
        va.varlen_attention(wide, wide, wide, cu, 4, 0.125, False)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(12, 1, 64), (8, 2, 128), (2, 8, 128), (4, 1, 32), (2, 2, 256)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_ref(va, dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, causal: bool) -> None:
    """16-bit (and IEEE float32) on the device: long and ragged sequences, every tile edge of every config."""
    batches = [[1], [128, 129, 1, 512, 7], [1000, 63, 2048, 255, 256, 300]]
    for i, lens in enumerate(batches):
        check(va, lens, num_kv_heads, group, head_dim, causal, dtype, seed=i)
