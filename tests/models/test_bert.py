"""BERT against transformers in float32 on CPU: a ragged batch packed through our varlen forward against
transformers' padded forward (attention_mask), every token's hidden state to 1e-5, the classifier's logits
on the [CLS] rows; token types 1 on each sequence's second segment. Checkpoints are tiny random-weight ones
saved by transformers (tests/fixtures/tiny_encoders.py) and loaded through model_loader/encoder.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncllm.attention.varlen import EncoderBatch
from asyncllm.config import LoadFormat
from asyncllm.errors import UnsupportedModelError
from asyncllm.layers.fusion import use_fused_kernels
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.model_loader.encoder import load_encoder
from asyncllm.models.base import EncoderModel
from asyncllm.models.config import ModelArchConfig
from tests.fixtures.tiny_encoders import VOCAB, build_bert_checkpoint
from tests.fixtures.triton_kernels import import_kernel

LENGTHS = [7, 1, 19, 12]  # a length-1 sequence ([CLS] alone) among ragged ones


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bert")
    return {
        "embed": build_bert_checkpoint(root / "embed", "BertModel", seed=1),
        "cross": build_bert_checkpoint(root / "cross", "BertForSequenceClassification", seed=2, num_labels=1),
        "labels3": build_bert_checkpoint(root / "labels3", "BertForSequenceClassification", seed=3, num_labels=3),
        "tanh": build_bert_checkpoint(root / "tanh", "BertModel", seed=4, hidden_act="gelu_new"),
    }


def load_ours(path: Path) -> EncoderModel:
    ckpt = open_checkpoint(str(path), torch.float32)
    arch = ModelArchConfig.from_hf(ckpt.hf_config, None)
    return load_encoder(ckpt, arch, torch.device("cpu"), torch.float32, LoadFormat.AUTO, seed=0)


def load_reference(path: Path, architecture: str) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, architecture)
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def random_sequences(lengths: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, token types) per sequence: [CLS] first, a [SEP] and type 1 from the middle on (sentence B)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        ids = torch.randint(5, len(VOCAB), (n,), generator=gen)
        ids[0] = VOCAB.index("[CLS]")
        types = torch.zeros(n, dtype=torch.long)
        if n > 2:
            ids[n // 2 - 1] = VOCAB.index("[SEP]")
            types[n // 2 :] = 1
        seqs.append((ids, types))
    return seqs


@torch.no_grad()
def ours_packed(
    model: EncoderModel, seqs: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, EncoderBatch]:
    batch = EncoderBatch.from_seq_lens([len(ids) for ids, _ in seqs], "cpu")
    ids = torch.cat([i for i, _ in seqs])
    types = torch.cat([t for _, t in seqs])
    positions = torch.cat([torch.arange(len(i)) for i, _ in seqs])
    return model(ids, positions, types, batch), batch


@torch.no_grad()
def reference_padded(ref: torch.nn.Module, seqs: list[tuple[torch.Tensor, torch.Tensor]]):
    longest = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (i, t) in enumerate(seqs):
        ids[row, : len(i)], types[row, : len(i)], mask[row, : len(i)] = i, t, 1
    return ref(input_ids=ids, attention_mask=mask, token_type_ids=types)


def assert_tokens_match(hidden: torch.Tensor, batch: EncoderBatch, padded: torch.Tensor) -> None:
    for seq, (row, n) in enumerate(zip(batch.first_rows_cpu, batch.seq_lens_cpu)):
        torch.testing.assert_close(hidden[row : row + n], padded[seq, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["embed", "tanh"])
def test_every_token_matches_transformers(checkpoints: dict[str, Path], name: str) -> None:
    """BertModel (exact erf GELU; and the gelu_new form): each packed token's final hidden state."""
    seqs = random_sequences(LENGTHS, seed=11)
    hidden, batch = ours_packed(load_ours(checkpoints[name]), seqs)
    reference = reference_padded(load_reference(checkpoints[name], "BertModel"), seqs)
    assert hidden.shape == (sum(LENGTHS), 32)
    assert_tokens_match(hidden, batch, reference.last_hidden_state)


@pytest.mark.parametrize("name", ["cross", "labels3"])
def test_classifier_logits_match_transformers(checkpoints: dict[str, Path], name: str) -> None:
    """BertForSequenceClassification (`bert.`-prefixed names): every token's state and the logits of the
    pooler + classifier on each sequence's [CLS] row."""
    model = load_ours(checkpoints[name])
    seqs = random_sequences(LENGTHS, seed=12)
    hidden, batch = ours_packed(model, seqs)
    reference = reference_padded(load_reference(checkpoints[name], "BertForSequenceClassification"), seqs)
    with torch.no_grad():
        logits = model.classify(hidden[batch.first_rows_cpu])
    assert model.classifies and model.num_labels == logits.shape[1] == (1 if name == "cross" else 3)
    torch.testing.assert_close(logits, reference.logits, atol=1e-5, rtol=1e-5)


def test_token_types_change_the_output(checkpoints: dict[str, Path]) -> None:
    """The segment embeddings are read: the same ids with every type 0 give other hidden states."""
    model = load_ours(checkpoints["embed"])
    seqs = random_sequences([9], seed=13)
    with_types, _ = ours_packed(model, seqs)
    without, _ = ours_packed(model, [(ids, torch.zeros_like(types)) for ids, types in seqs])
    assert not torch.allclose(with_types[5:], without[5:])


def test_packing_does_not_change_a_sequence(checkpoints: dict[str, Path]) -> None:
    """A sequence alone and the same sequence packed among others: the same states (to float32 rounding)."""
    model = load_ours(checkpoints["embed"])
    seqs = random_sequences([5, 13, 8], seed=14)
    packed, _ = ours_packed(model, seqs)
    alone, _ = ours_packed(model, seqs[1:2])
    torch.testing.assert_close(packed[5:18], alone, atol=1e-6, rtol=1e-6)


def test_weights_load_with_or_without_the_bert_prefix(checkpoints: dict[str, Path]) -> None:
    """A BertModel saved bare (sentence-transformers' form) and the same tensors named `bert.*`, with TF-era
    LayerNorm gamma/beta and the old position_ids buffer: one model."""
    path = checkpoints["embed"]
    tensors = load_file(path / "model.safetensors")
    assert not any(name.startswith("bert.") for name in tensors)
    renamed = {
        "bert." + name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): t
        for name, t in tensors.items()
    }
    renamed["bert.embeddings.position_ids"] = torch.arange(64)[None]
    ours, twin = load_ours(path), load_ours(path)
    twin.load_weights(renamed.items())
    seqs = random_sequences([6, 3], seed=15)
    torch.testing.assert_close(ours_packed(twin, seqs)[0], ours_packed(ours, seqs)[0], atol=0, rtol=0)


def test_a_missing_or_unknown_weight_is_named(checkpoints: dict[str, Path]) -> None:
    model = load_ours(checkpoints["cross"])
    tensors = load_file(checkpoints["cross"] / "model.safetensors")
    assert "bert.pooler.dense.weight" in tensors and "classifier.weight" in tensors
    without = {n: t for n, t in tensors.items() if n != "bert.encoder.layer.1.attention.self.key.bias"}
    with pytest.raises(UnsupportedModelError, match=r"missing 1 weight.*encoder\.layer\.1\.attention\.self\.key\.bias"):
        model.load_weights(without.items())
    for extra in ("bert.encoder.layer.0.crossattention.self.query.weight", "cls.predictions.bias"):
        with pytest.raises(UnsupportedModelError, match=extra.removeprefix("bert.").replace(".", r"\.")):
            model.load_weights([*tensors.items(), (extra, torch.zeros(32))])
    no_pooler = {n: t for n, t in tensors.items() if not n.startswith("bert.pooler.")}
    with pytest.raises(UnsupportedModelError, match=r"pooler\.dense\.weight"):
        model.load_weights(no_pooler.items())


def test_an_embedding_model_has_no_classifier(checkpoints: dict[str, Path]) -> None:
    model = load_ours(checkpoints["embed"])
    assert not model.classifies and model.num_labels is None
    with pytest.raises(UnsupportedModelError, match="BertModel has no classification head"):
        model.classify(torch.zeros(1, 32))


def test_fused_kernel_inside_the_model_matches_the_twin(checkpoints: dict[str, Path]) -> None:
    """The Triton varlen kernel (interpreted on CPU) in every layer: the same states as the torch twin."""
    import_kernel("varlen_attention")
    model = load_ours(checkpoints["cross"])
    seqs = random_sequences(LENGTHS, seed=16)
    twin, batch = ours_packed(model, seqs)
    assert use_fused_kernels(model) == 2  # one VarlenAttention per layer
    fused, _ = ours_packed(model, seqs)
    torch.testing.assert_close(fused, twin, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.classify(fused[batch.first_rows_cpu]), model.classify(twin[[0, 7, 8, 27]]))
