"""The OpenAI-compatible server, driven by the official `openai` client: a streamed chat answer and a
completion with usage, against a server started here in a background thread (what `asyncllm serve` runs).

python examples/openai_client.py [MODEL]   # default: the built-in SmolLM2
Needs the server extra and openai: pip install -e ".[server]" openai (from a clone; docs/install.md).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from typing import Any

import uvicorn
from openai import AsyncOpenAI

from asyncllm.server import create_app


def start_server(model: str, **app_args: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = create_app(model, served_model_name="local", engine_args={"num_kv_blocks": 512}, **app_args)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    while not server.started:  # the engine loads in the app's lifespan, before the port opens
        if not thread.is_alive():
            sys.exit("the server failed to start (see above)")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}/v1"


async def main(base_url: str) -> None:
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        stream = await client.chat.completions.create(
            model="local",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
            stream=True,
        )
        async for chunk in stream:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()
        done = await client.completions.create(model="local", prompt="Once upon a time", max_tokens=16, seed=7)
        print(repr(done.choices[0].text), done.choices[0].finish_reason, done.usage)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        from asyncllm.default_model import default_model_path  # raises with the install command if absent

        model = str(default_model_path())
    server, thread, base_url = start_server(model)
    try:
        asyncio.run(main(base_url))
    finally:
        server.should_exit = True  # uvicorn stops; the lifespan closes the engine
        thread.join()
