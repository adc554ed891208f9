"""`LLM.embed`, `LLM.score` and `LLM.rerank` on tiny checkpoints in their published forms, in float32 on CPU:
parity with transformers' forward plus sentence-transformers' pooling spelled out by hand (cosine >= 0.9999),
the Qwen3-Reranker's score from transformers' logits and a cross-encoder's from its classifier (1e-4), a
batch of mixed lengths equal to its inputs embedded one at a time, truncation, and the errors."""

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

from asyncllm import LLM, InvalidRequestError
from asyncllm.async_engine.pooling_inputs import RERANKER_INSTRUCTION, RERANKER_PREFIX, RERANKER_SUFFIX
from asyncllm.errors import InvalidConfigError
from tests.fixtures.pooling_models import (
    QUERY_PROMPT,
    add_sentence_transformers,
    build_qwen3_embedding,
    build_qwen3_reranker,
)
from tests.fixtures.tiny_encoders import build_bert_checkpoint

ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4)
TEXTS = ["Hello world", "The capital of France is Paris. The capital of Japan is Tokyo.", "café 日本語 😀"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    bert = build_bert_checkpoint(root / "bert", "BertModel")
    minilm = root / "minilm"
    shutil.copytree(bert, minilm)
    add_sentence_transformers(minilm, "mean", normalize=True, hidden_size=32)
    return {
        "embedding": build_qwen3_embedding(root / "embedding"),
        "reranker": build_qwen3_reranker(root / "reranker"),
        "bert": bert,
        "minilm": minilm,
        "cross": build_bert_checkpoint(root / "cross", "BertForSequenceClassification"),
    }


@pytest.fixture(scope="module")
def embedder(paths: dict[str, Path]) -> Iterator[LLM]:
    llm = LLM(str(paths["embedding"]), **ARGS)
    yield llm
    llm.shutdown()


def _cosine(a: torch.Tensor, b: list[float]) -> float:
    return F.cosine_similarity(a.double(), torch.tensor(b, dtype=torch.float64), dim=0).item()


def test_qwen3_embedding_equals_transformers_last_token_pooled(paths: dict[str, Path], embedder: LLM) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths["embedding"])
    model = transformers.Qwen3Model.from_pretrained(paths["embedding"], dtype=torch.float32).eval()
    got = embedder.embed(TEXTS, prompt_name="query")
    short = embedder.embed(TEXTS, prompt_name="query", dimensions=16)
    for text, out, cut in zip(TEXTS, got, short):
        ids = tokenizer(QUERY_PROMPT + text, return_tensors="pt").input_ids
        with torch.no_grad():
            last = model(ids).last_hidden_state[0, -1]
        want = F.normalize(last, dim=0)  # the Normalize module
        assert out.num_prompt_tokens == ids.shape[1] and len(out.embedding) == 64
        assert _cosine(want, out.embedding) >= 0.9999
        assert len(cut.embedding) == 16 and _cosine(F.normalize(want[:16], dim=0), cut.embedding) >= 0.9999
        assert abs(sum(x * x for x in cut.embedding) - 1.0) < 1e-5  # renormalised after the cut
    plain = embedder.embed(TEXTS[0])[0]  # no prompt_name: no prefix (no default_prompt_name)
    assert plain.num_prompt_tokens == len(tokenizer(TEXTS[0]).input_ids)


def test_a_batch_of_mixed_lengths_equals_one_input_at_a_time(embedder: LLM) -> None:
    rng = random.Random(7)
    inputs: list[Any] = [[rng.randrange(3, 380) for _ in range(rng.randrange(1, 200))] for _ in range(24)]
    inputs += TEXTS
    together = embedder.embed(inputs)
    for x, out in zip(inputs, together):
        alone = embedder.embed([x])[0]
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(alone.embedding), rtol=0, atol=2e-6)
    stats = embedder.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0


def test_truncation_keeps_the_last_tokens_and_longer_inputs_are_refused_naming_the_limit(embedder: LLM) -> None:
    long = [5 + i % 300 for i in range(700)]  # max_model_len is 512
    with pytest.raises(InvalidRequestError, match="input 1 has 700 tokens, more than this engine's limit of 512"):
        embedder.embed([[4, 5], long])
    kept = embedder.embed(long, truncate_prompt_tokens=50)[0]
    assert kept.num_prompt_tokens == 50
    torch.testing.assert_close(torch.tensor(kept.embedding), torch.tensor(embedder.embed(long[-50:])[0].embedding))
    assert embedder.embed(long, truncate_prompt_tokens=-1)[0].num_prompt_tokens == 512


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(inputs=""), "input 0 is empty"),
        (dict(inputs=[]), "inputs has 0 items"),
        (dict(inputs=[[1, 2], []]), "input 1=.* is invalid"),
        (dict(inputs=3), "inputs=3 is invalid"),
        (dict(inputs="x", dimensions=0), "dimensions=0 is invalid: give an integer from 1 to 64"),
        (dict(inputs="x", dimensions=65), "dimensions=65"),
        (dict(inputs="x", normalize="yes"), "normalize='yes'"),
        (dict(inputs="x", prompt_name="passage"), "prompt_name='passage' is not one of this model's prompts"),
        (dict(inputs=[[1, 2]], prompt_name="query"), "prompt_name applies to text inputs"),
        (dict(inputs="x", truncate_prompt_tokens=0), "truncate_prompt_tokens=0 is invalid"),
        (dict(inputs=[[1, 10**6]]), "token id 1000000 is outside the vocabulary"),
    ],
)
def test_bad_embed_calls_raise_naming_the_field(embedder: LLM, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        embedder.embed(**kwargs)
    assert embedder.stats()["num_waiting"] == 0


def test_generation_on_an_embed_engine_and_embedding_on_a_generate_engine_are_refused(
    embedder: LLM, tiny_model: Path
) -> None:
    with pytest.raises(InvalidRequestError, match="generate\\(\\) generates text, but this engine serves task='embed'"):
        embedder.generate("hi", use_tqdm=False)
    llm = LLM(str(tiny_model), **ARGS, num_kv_blocks=64)
    try:
        with pytest.raises(InvalidRequestError, match="embed\\(\\) needs an engine with task='embed'"):
            llm.embed("hi")
        with pytest.raises(InvalidRequestError, match="needs an engine with task='score' or 'embed'"):
            llm.rerank("q", ["d"])
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("arg", "value"), [("enable_lora", True), ("kv_offloading_size", 1.0), ("tensor_parallel_size", 2)]
)
def test_what_only_generation_has_is_refused_at_start(paths: dict[str, Path], arg: str, value: object) -> None:
    with pytest.raises(InvalidConfigError, match="is for generation; this engine serves task='embed'"):
        LLM(str(paths["embedding"]), **ARGS, **{arg: value})


def test_an_embed_engine_scores_by_cosine_similarity(embedder: LLM) -> None:
    vectors = [torch.tensor(e.embedding) for e in embedder.embed(TEXTS)]
    scores = embedder.score(TEXTS[0], TEXTS[1:])
    for v, s in zip(vectors[1:], scores):
        assert abs(F.cosine_similarity(vectors[0], v, dim=0).item() - s) < 1e-5
    ranked = embedder.rerank(TEXTS[0], TEXTS[1:], top_n=1)
    assert len(ranked) == 1 and ranked[0].relevance_score == max(scores)
    assert ranked[0].document == TEXTS[1 + ranked[0].index]


def test_the_qwen3_reranker_scores_p_yes_from_transformers_logits(paths: dict[str, Path]) -> None:
    path = paths["reranker"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    query, docs = "What is the capital of France?", ["Paris is the capital of France.", "Hello world", "日本語"]
    llm = LLM(str(path), task="score", **ARGS)
    try:
        got = llm.score(query, docs)
        custom = llm.score(query, docs[:1], instruction="Find the city")
        ranked = llm.rerank(query, docs)
    finally:
        llm.shutdown()
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    prefix = tokenizer.encode(RERANKER_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANKER_SUFFIX, add_special_tokens=False)

    def want(instruction: str, doc: str) -> float:
        pair = tokenizer.encode(
            f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}", add_special_tokens=False
        )
        with torch.no_grad():
            logits = model(torch.tensor([prefix + pair + suffix])).logits[0, -1]
        return torch.softmax(logits[[no, yes]], dim=0)[1].item()

    for doc, score in zip(docs, got):
        assert abs(want(RERANKER_INSTRUCTION, doc) - score) < 1e-4
    assert abs(want("Find the city", docs[0]) - custom[0]) < 1e-4
    assert [r.index for r in ranked] == sorted(range(3), key=lambda i: -got[i])


def test_bert_embeddings_pool_as_sentence_transformers_does(paths: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths["bert"])
    model = transformers.BertModel.from_pretrained(paths["bert"], dtype=torch.float32).eval()
    texts = ["hello world", "the cat sat on the mat", "paris"]
    for name, pooled in [("minilm", lambda h: h.mean(0)), ("bert", lambda h: h[0])]:  # mean + Normalize; CLS
        llm = LLM(str(paths[name]), **ARGS)
        try:
            got = llm.embed(texts)
        finally:
            llm.shutdown()
        for text, out in zip(texts, got):
            with torch.no_grad():
                hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            assert _cosine(F.normalize(pooled(hidden), dim=0), out.embedding) >= 0.9999, name


def test_a_cross_encoder_scores_as_its_classifier(paths: dict[str, Path]) -> None:
    path = paths["cross"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    query, docs = "the capital", ["paris is the capital of france", "the cat sat on the mat", "hello"]
    llm = LLM(str(path), **ARGS)
    try:
        got = llm.score(query, docs)
        with pytest.raises(InvalidRequestError, match="instruction applies to a yes/no reranker"):
            llm.score(query, docs, instruction="x")
    finally:
        llm.shutdown()
    enc = tokenizer([query] * len(docs), docs, return_tensors="pt", padding=True)
    with torch.no_grad():
        want = torch.sigmoid(model(**enc).logits[:, 0])
    assert max(abs(w - g) for w, g in zip(want.tolist(), got)) < 1e-4


def test_sentence_transformers_max_seq_length_is_the_default_limit(paths: dict[str, Path], tmp_path: Path) -> None:
    """Regression (issue 43 review): sentence_bert_config.json's max_seq_length was ignored (all-MiniLM-L6-v2
    truncates at 256 of its 512 positions). Without an explicit max_model_len it is the engine's limit (the
    smaller of it and max_position_embeddings, as in vLLM); an explicit one up to max_position_embeddings
    still holds, and one past them is still refused."""
    short = tmp_path / "short"
    shutil.copytree(paths["minilm"], short)
    add_sentence_transformers(short, "mean", normalize=True, hidden_size=32, max_seq_length=24)
    text = [5 + i for i in range(30)]
    llm = LLM(str(short), **ARGS)
    try:
        with pytest.raises(InvalidRequestError, match="input 0 has 30 tokens, more than this engine's limit of 24"):
            llm.embed([text])
        assert llm.embed([text], truncate_prompt_tokens=-1)[0].num_prompt_tokens == 24
    finally:
        llm.shutdown()
    llm = LLM(str(short), **ARGS, max_model_len=40)  # under the BERT's 64 positions: the caller's choice
    try:
        assert llm.embed([text])[0].num_prompt_tokens == 30
    finally:
        llm.shutdown()
    with pytest.raises(InvalidConfigError, match="max_position_embeddings"):
        LLM(str(short), **ARGS, max_model_len=65)
    roomy = tmp_path / "roomy"  # a max_seq_length past the positions: max_position_embeddings bounds it
    shutil.copytree(paths["minilm"], roomy)
    add_sentence_transformers(roomy, "mean", normalize=True, hidden_size=32, max_seq_length=1000)
    llm = LLM(str(roomy), **ARGS)
    try:
        assert llm.embed([[5] * 70], truncate_prompt_tokens=-1)[0].num_prompt_tokens == 64
    finally:
        llm.shutdown()


def test_truncating_a_bert_text_keeps_its_cls_token(paths: dict[str, Path]) -> None:
    """Regression: `truncate_prompt_tokens` sliced the last k ids after the tokenizer added [CLS] ... [SEP], so a
    truncated BERT text lost its [CLS] and a CLS-pooling embedder pooled a word instead (no error). It now
    truncates as transformers' left truncation does: the special tokens stay, the text's first words go."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths["bert"], truncation_side="left")
    model = transformers.BertModel.from_pretrained(paths["bert"], dtype=torch.float32).eval()
    text = "the cat sat on the mat in paris " * 3
    llm = LLM(str(paths["bert"]), **ARGS)
    try:
        got = llm.embed(text, truncate_prompt_tokens=8)[0]
    finally:
        llm.shutdown()
    enc = tokenizer(text, truncation=True, max_length=8, return_tensors="pt")
    assert enc.input_ids[0, 0].item() == tokenizer.cls_token_id and got.num_prompt_tokens == 8
    with torch.no_grad():
        cls = model(**enc).last_hidden_state[0, 0]
    assert _cosine(F.normalize(cls, dim=0), got.embedding) >= 0.9999


def test_token_types_past_the_models_type_vocab_size_are_refused_before_the_device(tmp_path: Path) -> None:
    """Regression: a cross-encoder with type_vocab_size=1 got its tokenizer's pair types (0, then 1) into its
    token-type embedding: an IndexError on CPU, a device-side assert on CUDA. Refused naming the field now,
    and the engine goes on serving."""
    path = build_bert_checkpoint(tmp_path / "cross", "BertForSequenceClassification", type_vocab_size=1)
    llm = LLM(str(path), **ARGS)
    try:
        with pytest.raises(InvalidRequestError, match=r"token_type_ids .*type_vocab_size is 1"):
            llm.score("the capital", ["paris"])
        assert llm.stats()["num_waiting"] == 0 and llm.stats()["num_running"] == 0
    finally:
        llm.shutdown()
