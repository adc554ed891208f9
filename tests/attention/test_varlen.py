"""attention/varlen.py: `EncoderBatch` (one forward's packed layout, validated) and `VarlenAttention`, whose
torch twin is the specification and whose fused form (the Triton kernel, in the interpreter on CPU) must
agree with it."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.varlen import EncoderBatch, VarlenAttention, varlen_attention
from asyncllm.kernels.varlen_attention_ref import varlen_attention_ref
from asyncllm.layers.fusion import use_fused_kernels
from tests.fixtures.triton_kernels import DEVICE, import_kernel


def test_batch_from_seq_lens() -> None:
    batch = EncoderBatch.from_seq_lens([3, 1, 5], "cpu")
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 9] and batch.cu_seqlens.dtype == torch.int32
    assert (batch.num_seqs, batch.num_tokens, batch.max_seqlen) == (3, 9, 5)
    assert batch.first_rows_cpu == [0, 3, 4]


@pytest.mark.parametrize(
    ("lens", "max_seqlen", "match"),
    [([], 0, "one int >= 1"), ([2, 0], 2, "one int >= 1"), ([2, 3], 2, "max_seqlen=2 must equal")],
)
def test_batch_rejects_a_bad_layout(lens: list[int], max_seqlen: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EncoderBatch(torch.zeros(len(lens) + 1, dtype=torch.int32), lens, max_seqlen)


def test_batch_rejects_cu_seqlens_of_another_shape_or_dtype() -> None:
    with pytest.raises(ValueError, match=r"int32 \[B \+ 1\] = \[3\]"):
        EncoderBatch(torch.tensor([0, 2, 5]), [2, 3], 3)  # int64
    with pytest.raises(ValueError, match=r"int32 \[B \+ 1\]"):
        EncoderBatch(torch.tensor([0, 5], dtype=torch.int32), [2, 3], 3)


def _qkv(lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return (
        torch.randn(t, heads, head_dim, generator=gen),
        torch.randn(t, kv_heads, head_dim, generator=gen),
        torch.randn(t, kv_heads, head_dim, generator=gen),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_layer_twin_is_the_reference(causal: bool) -> None:
    lens = [4, 1, 11]
    q, k, v = _qkv(lens, 4, 2, 16, seed=int(causal))
    layer = VarlenAttention(4, 2, 16, causal=causal)
    out = layer(q, k, v, EncoderBatch.from_seq_lens(lens, "cpu"))
    assert out.shape == (16, 64) and not layer.fused
    torch.testing.assert_close(out, varlen_attention_ref(q, k, v, lens, 16**-0.5, causal).reshape(16, 64))


def test_bidirectional_attention_sees_later_tokens() -> None:
    """An encoder's first token depends on the last one; a causal layer's does not."""
    lens = [6]
    q, k, v = _qkv(lens, 2, 2, 8, seed=1)
    batch = EncoderBatch.from_seq_lens(lens, "cpu")
    v2 = v.clone()
    v2[-1] += 1.0
    both = VarlenAttention(2, 2, 8), VarlenAttention(2, 2, 8, causal=True)
    bidirectional, causal = ((layer(q, k, v, batch), layer(q, k, v2, batch)) for layer in both)
    assert not torch.equal(bidirectional[0][0], bidirectional[1][0])
    assert torch.equal(causal[0][:5], causal[1][:5])


@pytest.mark.parametrize("causal", [False, True])
def test_fused_layer_matches_the_twin(causal: bool) -> None:
    """`use_fused_kernels` switches the layer to the Triton kernel (interpreted on CPU); same output."""
    import_kernel("varlen_attention")  # skips without triton; the interpreter without CUDA
    lens = [7, 1, 40, 2]
    q, k, v = (t.to(DEVICE) for t in _qkv(lens, 4, 1, 32, seed=7 + int(causal)))
    batch = EncoderBatch.from_seq_lens(lens, DEVICE)
    layer = VarlenAttention(4, 1, 32, causal=causal)
    twin = layer(q, k, v, batch)
    assert use_fused_kernels(layer) == 1 and layer.fused
    torch.testing.assert_close(layer(q, k, v, batch), twin, atol=1e-5, rtol=1e-5)


def test_rows_must_match_the_batch() -> None:
    q, k, v = _qkv([3, 3], 2, 2, 8, seed=0)
    with pytest.raises(ValueError, match="q has 6 rows but the batch's sequences hold 5 tokens"):
        varlen_attention(q, k, v, EncoderBatch.from_seq_lens([2, 3], "cpu"), 0.5, False)


def test_heads_must_group() -> None:
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        VarlenAttention(3, 2, 8)
