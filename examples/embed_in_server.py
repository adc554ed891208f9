"""The engine inside a Starlette app: started and stopped with the app's lifespan, answers streamed as
server-sent events. A client that disconnects cancels its handler, which aborts its request.

python examples/embed_in_server.py [MODEL]   # one request in-process through httpx; or, with
ASYNCLLM_MODEL set, serve it: `uvicorn embed_in_server:app`   (pip install 'asyncllm[dev]' for starlette)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asyncllm import AsyncLLMEngine, SamplingParams


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with AsyncLLMEngine(os.environ["ASYNCLLM_MODEL"]) as engine:
        app.state.engine = engine
        yield


async def generate(request: Request) -> StreamingResponse:
    engine: AsyncLLMEngine = request.app.state.engine
    body = await request.json()
    params = SamplingParams(temperature=0.0, max_tokens=int(body.get("max_tokens", 32)))
    stream = engine.stream(body["prompt"], params)  # a bad prompt raises here, before any byte is sent

    async def events() -> AsyncIterator[str]:
        async for chunk in stream:
            yield f"data: {json.dumps({'text': chunk.text, 'finish_reason': chunk.finish_reason})}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/generate", generate, methods=["POST"])], lifespan=lifespan)


async def demo() -> None:
    import httpx

    payload = {"prompt": "The capital of France is", "max_tokens": 24}
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://demo")
    async with (
        app.router.lifespan_context(app),  # what a server runs at startup and shutdown
        client,
        client.stream("POST", "/generate", json=payload) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                print(line[6:])  # one JSON object per chunk


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.environ["ASYNCLLM_MODEL"] = sys.argv[1]
    elif "ASYNCLLM_MODEL" not in os.environ:
        from asyncllm.default_model import default_model_path  # raises with the install command if absent

        os.environ["ASYNCLLM_MODEL"] = str(default_model_path())
    asyncio.run(demo())
