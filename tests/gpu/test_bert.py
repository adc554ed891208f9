"""BERT on the GPU with the Triton varlen kernel in every layer (skipped without CUDA): the same hidden states
and classifier logits as the torch twin on the same card, and as transformers' padded forward, in bfloat16 (a
BERT-base head shape: 12 heads of 64; 300 ragged tokens a sequence at most, the kernel's tile edges crossed)
and float32. The kernel against its twin alone: tests/kernels/test_varlen_attention.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.attention.varlen import EncoderBatch
from asyncllm.config import LoadFormat
from asyncllm.layers.fusion import use_fused_kernels
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.model_loader.encoder import load_encoder
from asyncllm.models.config import ModelArchConfig
from tests.fixtures.tiny_encoders import VOCAB, build_bert_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
LENGTHS = [300, 1, 129, 64, 17]
# bfloat16 keeps 8 bits of mantissa: hidden states of unit scale agree to a few of its steps after 2 layers.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = dict(hidden_size=768, num_attention_heads=12, intermediate_size=1024, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("bert")
    return build_bert_checkpoint(path, "BertForSequenceClassification", std=0.04, **shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernel_matches_twin_and_transformers(cross_encoder: Path, dtype: torch.dtype) -> None:
    ckpt = open_checkpoint(str(cross_encoder), dtype)
    arch = ModelArchConfig.from_hf(ckpt.hf_config, None)
    model = load_encoder(ckpt, arch, CUDA, dtype, LoadFormat.AUTO, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(VOCAB), (sum(LENGTHS),), generator=gen).to(CUDA)
    types = torch.cat([(torch.arange(n) >= n // 2).long() for n in LENGTHS]).to(CUDA)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).to(CUDA)
    batch = EncoderBatch.from_seq_lens(LENGTHS, CUDA)
    with torch.no_grad():
        twin = model(ids, positions, types, batch)
        assert use_fused_kernels(model) == 2
        fused = model(ids, positions, types, batch)
        logits = model.classify(fused[batch.first_rows_cpu])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fused.float(), twin.float(), atol=tol, rtol=tol)

    import transformers

    ref = transformers.BertForSequenceClassification.from_pretrained(cross_encoder, dtype=dtype).to(CUDA).eval()
    longest = max(LENGTHS)
    padded, mask, ptypes = (torch.zeros(len(LENGTHS), longest, dtype=torch.long, device=CUDA) for _ in range(3))
    for i, (row, n) in enumerate(zip(batch.first_rows_cpu, LENGTHS)):
        padded[i, :n], mask[i, :n], ptypes[i, :n] = ids[row : row + n], 1, types[row : row + n]
    with torch.no_grad():
        out = ref(input_ids=padded, attention_mask=mask, token_type_ids=ptypes, output_hidden_states=True)
    for i, (row, n) in enumerate(zip(batch.first_rows_cpu, LENGTHS)):
        torch.testing.assert_close(
            fused[row : row + n].float(), out.hidden_states[-1][i, :n].float(), atol=tol, rtol=tol
        )
    torch.testing.assert_close(logits.float(), out.logits.float(), atol=tol, rtol=tol)
