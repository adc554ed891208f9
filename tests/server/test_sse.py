"""The exact wire format of streamed responses, read raw (no client library smoothing it over): one JSON
object per `data:` event, each choice's role first, the finish reason on an empty last delta, `usage` null on
every chunk and filled on a final choice-less one when asked for, then `data: [DONE]`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.core.detokenizer import backend_tokenizer
from asyncllm.server import create_app
from tests.fixtures.fake_core import fake_built
from tests.fixtures.tiny_models import build_tokenizer
from tests.server.conftest import MODEL
from tests.server.serving import RunningServer, start_server


def _events(server: RunningServer, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    assert raw.endswith("\n\n") and not raw.startswith("\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_chat_stream_shape(server: RunningServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    events = _events(
        server, "/chat/completions", {**body, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    )
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL and "usage" in e for e in events)
    assert len({(e["id"], e["created"]) for e in events}) == 1
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert all(e["usage"] is None and len(e["choices"]) == 1 for e in chunks)
    for index in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""} and mine[0]["finish_reason"] is None
        assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in mine[1:-1])
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"


def test_chat_stream_without_usage_has_no_usage_key(server: RunningServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    events = _events(server, "/chat/completions", body)
    assert all("usage" not in e and len(e["choices"]) == 1 for e in events)


def test_completion_stream_shape(server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True}
    events = _events(server, "/completions", {**body, "stream_options": {"include_usage": True}})
    *chunks, last = events
    assert all(e["object"] == "text_completion" for e in events)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    choices = [e["choices"][0] for e in chunks]
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason"} for c in choices)
    assert [c["finish_reason"] for c in choices][-1] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])


class _Spell:
    """A next-token function that spells `ids` over and over (picked by how many tokens follow the prompt)."""

    def __init__(self, ids: list[int], prompt_len: int) -> None:
        self.ids, self.prompt_len = ids, prompt_len

    def __call__(self, tokens: Any) -> int:
        return self.ids[(len(tokens) - self.prompt_len) % len(self.ids)]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_every_frame_is_the_canonical_json_of_its_chunk(path: str, tmp_path: Path) -> None:
    """Chunks are written from a template, not by encoding each chunk whole: a frame's bytes must still be
    exactly what `json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))` writes, quotes, backslashes,
    newlines, control characters, line separators and emoji included, and the texts must add up."""
    tokenizer = build_tokenizer(tmp_path)
    text = 'say "hi"\\n, a\ttab\nnew line \u2028 \x01 😀 café 日本'
    ids = tokenizer(text).input_ids
    messages = [{"role": "user", "content": "Hello"}]
    prompt = tokenizer("Hello").input_ids if path == "/completions" else None
    spell = _Spell(ids, len(prompt or []))
    built = fake_built(backend_tokenizer(tokenizer), next_token=spell, max_model_len=4096)
    engine = AsyncLLMEngine.from_builder(lambda: built)
    engine.tokenizer = tokenizer  # the chat template comes from the front's tokenizer
    if prompt is None:
        spell.prompt_len = len(engine.apply_chat_template(messages))
    running = start_server(create_app(engine, served_model_name="spell"))
    try:
        body: dict[str, Any] = {"model": "spell", "max_tokens": 3 * len(ids), "stream": True, "ignore_eos": True}
        body |= {"prompt": prompt} if prompt else {"messages": messages}
        with httpx.stream("POST", f"{running.base_url}{path}", json=body, timeout=30) as response:
            raw = b"".join(response.iter_bytes())
    finally:
        running.stop()
        engine.shutdown()
    frames = raw.split(b"\n\n")[:-2]  # the last two: [DONE] and the empty tail
    got = ""
    for frame in frames:
        chunk = json.loads(frame[len(b"data: ") :])
        assert frame == b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
        choice = chunk["choices"][0]
        got += choice["text"] if "text" in choice else choice["delta"].get("content", "")
    assert got == text * 3
