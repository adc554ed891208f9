"""POST /v1/embeddings, /v1/rerank and /v1/score on tiny embed and score engines behind real servers: the
official openai client's `embeddings.create` unchanged (it asks for base64), floats and base64 equal to the
engine's vectors, usage, the Jina/Cohere rerank shape, vLLM's score shape, metrics, and the 400s, 404 and
429 (a generation endpoint on an embed server and the reverse included)."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.fixtures.pooling_models import build_qwen3_embedding
from tests.fixtures.tiny_encoders import build_bert_checkpoint
from tests.server.conftest import metric_value
from tests.server.serving import RunningServer, start_server

ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4)
TEXTS = ["Hello world", "The capital of France is Paris.", "emoji 😀"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling_server")
    return {
        "embed": build_qwen3_embedding(root / "embed"),
        "cross": build_bert_checkpoint(root / "cross", "BertForSequenceClassification"),
    }


@pytest.fixture(scope="module")
def embedder(paths: dict[str, Path]) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(str(paths["embed"]), **ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def embed_server(embedder: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(embedder, served_model_name="emb"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def score_server(paths: dict[str, Path]) -> Iterator[RunningServer]:
    engine = AsyncLLMEngine(str(paths["cross"]), **ARGS)
    running = start_server(create_app(engine, served_model_name="cross"))
    yield running
    running.stop()
    engine.shutdown()


async def test_the_openai_client_embeds_unchanged(embed_server: RunningServer, embedder: AsyncLLMEngine) -> None:
    want = await embedder.embed(TEXTS)
    with openai.OpenAI(base_url=embed_server.base_url, api_key="unused", max_retries=0) as client:
        r = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 and decodes it
        floats = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float", dimensions=8)
        ids = client.embeddings.create(model="emb", input=[[5, 6, 7], [8, 9]])
    assert r.object == "list" and r.model == "emb" and [d.index for d in r.data] == [0, 1, 2]
    for d, w in zip(r.data, want):
        assert d.object == "embedding" and d.embedding == pytest.approx(w.embedding, abs=1e-6)
    tokens = sum(w.num_prompt_tokens for w in want)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (tokens, tokens)
    (short,) = floats.data
    assert short.embedding == pytest.approx((await embedder.embed(TEXTS[0], dimensions=8))[0].embedding, abs=1e-6)
    assert ids.usage.prompt_tokens == 5 and len(ids.data) == 2


def test_base64_is_little_endian_float32(embed_server: RunningServer) -> None:
    body = {"model": "emb", "input": TEXTS[1]}
    floats = httpx.post(f"{embed_server.base_url}/embeddings", json=body, timeout=30).json()
    packed = httpx.post(f"{embed_server.base_url}/embeddings", json={**body, "encoding_format": "base64"}, timeout=30)
    raw = base64.b64decode(packed.json()["data"][0]["embedding"])
    vector = floats["data"][0]["embedding"]
    assert struct.unpack(f"<{len(vector)}f", raw) == pytest.approx(vector, rel=1e-6)


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"model": "emb", "input": []}, 400, "input", "inputs has 0 items"),
        ({"model": "emb", "input": ""}, 400, "input", "input 0 is empty"),
        ({"model": "emb", "input": "x", "dimensions": 0}, 400, "dimensions", "dimensions=0 is invalid"),
        ({"model": "emb", "input": "x", "encoding_format": "int8"}, 400, "encoding_format", "encoding_format"),
        ({"model": "emb", "input": "x", "nonsense": 1}, 400, "nonsense", "Unrecognized request argument"),
        ({"model": "emb", "input": [[1, 10**6]]}, 400, "input", "outside the vocabulary"),
        ({"model": "other", "input": "x"}, 404, "model", "does not exist"),
        ({"model": "emb", "input": ["x"] * 2049}, 400, "input", "input has 2049 items, more than 2048"),
    ],
)
def test_bad_embedding_requests_name_the_field(
    embed_server: RunningServer, body: dict[str, Any], status: int, param: str, message: str
) -> None:
    r = httpx.post(f"{embed_server.base_url}/embeddings", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == status and error["param"] == param and message in error["message"], error


def test_generation_on_an_embed_server_and_embeddings_on_a_generate_server_are_400s(
    embed_server: RunningServer, server: RunningServer
) -> None:
    chat = {"model": "emb", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{embed_server.base_url}/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and "this engine serves task='embed'" in r.json()["error"]["message"]
    r = httpx.post(f"{embed_server.base_url}/completions", json={"model": "emb", "prompt": "hi"}, timeout=30)
    assert r.status_code == 400 and "task='embed'" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/embeddings", json={"model": "tiny", "input": "hi"}, timeout=30)
    assert r.status_code == 400 and "needs an engine with task='embed'" in r.json()["error"]["message"]


def test_rerank_and_score_on_a_cross_encoder(score_server: RunningServer) -> None:
    docs = ["paris is the capital of france", "the cat sat on the mat", "hello"]
    body = {"model": "cross", "query": "the capital", "documents": docs}
    scored = httpx.post(f"{score_server.base_url}/score", json={"text_1": "the capital", "text_2": docs}, timeout=30)
    assert scored.status_code == 200, scored.text
    scores = [d["score"] for d in scored.json()["data"]]
    assert [d["index"] for d in scored.json()["data"]] == [0, 1, 2] and scored.json()["usage"]["total_tokens"] > 0
    r = httpx.post(f"{score_server.base_url}/rerank", json=body, timeout=30).json()
    order = sorted(range(3), key=lambda i: -scores[i])
    assert [x["index"] for x in r["results"]] == order
    assert [x["relevance_score"] for x in r["results"]] == pytest.approx([scores[i] for i in order], abs=1e-6)
    assert r["results"][0]["document"] == {"text": docs[order[0]]} and r["usage"]["total_tokens"] > 0
    objects = {**body, "documents": [{"text": d} for d in docs], "top_n": 1, "return_documents": False}
    cohere = httpx.post(f"{score_server.url}/v2/rerank", json=objects, timeout=30).json()
    assert cohere["results"] == [{"index": order[0], "relevance_score": pytest.approx(scores[order[0]], abs=1e-6)}]
    bad = httpx.post(f"{score_server.base_url}/rerank", json={**body, "top_n": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_n"
    empty = httpx.post(f"{score_server.base_url}/score", json={"text_1": "", "text_2": "x"}, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "text_1"
    wrong = httpx.post(f"{score_server.base_url}/embeddings", json={"model": "cross", "input": "x"}, timeout=30)
    assert wrong.status_code == 400 and "task='score'" in wrong.json()["error"]["message"]


def test_calls_are_counted_in_metrics(embed_server: RunningServer) -> None:
    labels = dict(model_name="emb", endpoint="embeddings")
    before = metric_value(embed_server, "asyncllm_pooling_requests_total", outcome="ok", **labels)
    stops = metric_value(embed_server, "vllm:request_success_total", model_name="emb", finished_reason="stop")
    httpx.post(f"{embed_server.base_url}/embeddings", json={"model": "emb", "input": TEXTS}, timeout=30)
    httpx.post(f"{embed_server.base_url}/embeddings", json={"model": "emb", "input": []}, timeout=30)
    assert metric_value(embed_server, "asyncllm_pooling_requests_total", outcome="ok", **labels) == before + 1
    assert metric_value(embed_server, "asyncllm_pooling_requests_total", outcome="invalid", **labels) >= 1
    after = metric_value(embed_server, "vllm:request_success_total", model_name="emb", finished_reason="stop")
    assert after == stops + len(TEXTS)
    assert metric_value(embed_server, "asyncllm_pooling_request_duration_seconds_count", **labels) >= 1


def test_an_overloaded_engine_answers_429(paths: dict[str, Path]) -> None:
    engine = AsyncLLMEngine(str(paths["embed"]), **ARGS, max_waiting_requests=1)
    running = start_server(create_app(engine, served_model_name="emb"))
    try:
        r = httpx.post(f"{running.base_url}/embeddings", json={"model": "emb", "input": TEXTS}, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] and "max_waiting_requests=1" in r.text
        ok = httpx.post(f"{running.base_url}/embeddings", json={"model": "emb", "input": "one"}, timeout=30)
        assert ok.status_code == 200
    finally:
        running.stop()
        engine.shutdown()
