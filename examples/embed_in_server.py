"""The engine inside a Starlette app: started and stopped with the app's lifespan, answers streamed as
server-sent events. A client that disconnects cancels its handler, which aborts its request.

python examples/embed_in_server.py [MODEL]   # one request in-process through httpx; or, with
ASYNCLLM_MODEL set, serve it: `uvicorn embed_in_server:app`   (needs: pip install starlette httpx)
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
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asyncllm import AsyncLLMEngine, InvalidRequestError, SamplingParams


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with AsyncLLMEngine(os.environ["ASYNCLLM_MODEL"]) as engine:
        app.state.engine = engine
        yield


async def generate(request: Request) -> Response:
    engine: AsyncLLMEngine = request.app.state.engine
    try:  # the client's mistakes are a 400, found before any byte of the stream is sent
        body = await request.json()
        params = SamplingParams(temperature=0.0, max_tokens=body.get("max_tokens", 32))
        stream = engine.stream(body.get("prompt"), params)
        first = await anext(stream)  # a text prompt's length in tokens is checked here
    except (InvalidRequestError, json.JSONDecodeError) as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)

    async def events() -> AsyncIterator[str]:
        try:
            chunk = first
            while True:
                yield f"data: {json.dumps({'text': chunk.text, 'finish_reason': chunk.finish_reason})}\n\n"
                if chunk.finish_reason is not None:
                    return
                chunk = await anext(stream)
        finally:
            stream.close()  # the client left early: abort the request (a no-op once it ended)

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
        refused = await client.post("/generate", json={"prompt": ""})  # a bad prompt: 400, naming it
        print(json.dumps({"status": refused.status_code, **refused.json()}))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.environ["ASYNCLLM_MODEL"] = sys.argv[1]
    elif "ASYNCLLM_MODEL" not in os.environ:
        from asyncllm.default_model import default_model_path  # raises with the install command if absent

        os.environ["ASYNCLLM_MODEL"] = str(default_model_path())
    asyncio.run(demo())
