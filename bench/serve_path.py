"""The server's own cost per streamed chunk, without the engine, uvicorn or a socket: the app (routing, the
request body, the endpoint, the SSE frames, the streaming response, Starlette's send wrappers) driven as
ASGI by a scripted engine whose streams hand out ready chunks. CPU microseconds per chunk on one thread,
so two trees compare on a busy machine (run it under each tree's PYTHONPATH, alternating).

    python bench/serve_path.py [--requests 256] [--concurrency 64] [--tokens 128] [--rounds 5] [--chat]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from asyncllm import SamplingParams, StreamOutput
from asyncllm.input_limits import PromptBounds
from asyncllm.outputs import RequestMetrics

_WORDS = [" the", " engine", " streams", " every", " token", ",", " and", " the", " server", " writes", " it", "."]


class _Stream:
    def __init__(self, request_id: str, prompt: Any, tokens: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt) if isinstance(prompt, list) else (1, 2, 3)
        self._tokens = tokens
        self._closed = False

    def close(self) -> None:
        self._closed = True

    async def __aiter__(self) -> Any:
        for i in range(self._tokens):
            await asyncio.sleep(0)  # each chunk costs the consumer a wake-up, as the engine's do
            last = i == self._tokens - 1
            metrics = RequestMetrics(0.01, 0.5, len(self.prompt_token_ids), self._tokens, 0) if last else None
            yield StreamOutput(
                self.request_id, _WORDS[i % len(_WORDS)], (100 + i,), "length" if last else None, metrics
            )


class ScriptedEngine:
    """What the app uses of `AsyncLLMEngine`, with streams that hand out `tokens` one-token chunks."""

    config = None
    runtime = None

    def __init__(self, tokens: int, tokenizer: Any = None) -> None:
        self.tokens = tokens
        self.tokenizer = tokenizer

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str, **_: Any) -> _Stream:
        return _Stream(request_id, prompt, self.tokens)

    def list_loras(self) -> list[str]:
        return []

    def stats(self) -> dict[str, float | int]:
        return {}

    @property
    def prompt_bounds(self) -> PromptBounds:
        """A real engine's bound for its longest sequence, here no vocabulary to count characters by."""
        return PromptBounds(max_tokens=32_768, max_chars=None)


async def one(app: Any, body: bytes, path: str) -> int:
    sent = 0
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        nonlocal sent
        if message["type"] == "http.response.body" and message.get("body"):
            sent += message["body"].count(b"data: ")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    await app(scope, receive, send)
    return sent


async def run(app: Any, args: argparse.Namespace) -> float:
    if args.chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    else:
        path, body = "/v1/completions", {"prompt": [1, 2, 3, 4]}
    raw = json.dumps({"model": "bench", "max_tokens": args.tokens, "stream": True, **body}).encode()
    gate = asyncio.Semaphore(args.concurrency)

    async def gated() -> int:
        async with gate:
            return await one(app, raw, path)

    cpu = time.process_time()
    events = sum(await asyncio.gather(*(gated() for _ in range(args.requests))))
    return (time.process_time() - cpu) / events * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chat", action="store_true", help="the chat endpoint (a tiny template) instead of completions")
    args = ap.parse_args()
    import uvloop

    from asyncllm.server import create_app

    tokenizer = None
    if args.chat:
        from transformers import PreTrainedTokenizerFast

        tokenizer = _chat_tokenizer(PreTrainedTokenizerFast)
    app = create_app(ScriptedEngine(args.tokens, tokenizer), served_model_name="bench")  # type: ignore[arg-type]
    per_event = [uvloop.run(run(app, args)) for _ in range(args.rounds)]
    print(
        json.dumps(
            {
                "bench": "serve_path",
                "endpoint": "chat" if args.chat else "completions",
                "cpu_us_per_event_median": round(statistics.median(per_event), 2),
                "cpu_us_per_event_min": round(min(per_event), 2),
                "rounds": [round(x, 2) for x in per_event],
            }
        )
    )


def _chat_tokenizer(cls: Any) -> Any:
    import tempfile
    from pathlib import Path

    from tests.fixtures.tiny_models import build_tokenizer

    return build_tokenizer(Path(tempfile.mkdtemp()))


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
