"""The OpenAI-compatible server as a Ray Serve deployment, for those who run Ray Serve already: the server
app is the deployment's ingress, and each Serve replica runs it with its own engine (built in the app's
lifespan, on the replica's GPU). Serve spreads requests over the replicas and restarts one that fails.

python examples/ray_serve.py [MODEL] [--replicas 2] [--port 8000] [--smoke]   # needs "ray[serve]"
  --smoke: send one chat request through the deployment, print the reply, and shut down.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ray import serve

from asyncllm.server import create_app


def deployment(model: str, replicas: int, engine_args: dict[str, Any], gpus: float) -> Any:
    def build_app() -> Any:  # called in each Serve replica (a plain function: Serve builds the app there)
        return create_app(model, served_model_name="asyncllm", engine_args=engine_args)

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_gpus": gpus, "num_cpus": 1})
    @serve.ingress(build_app)
    class AsyncLLMServer:
        pass

    return AsyncLLMServer.bind()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="checkpoint directory or .gguf (default: the built-in SmolLM2)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--gpus", type=float, default=0.0, help="GPUs per replica (1 on a GPU cluster)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from asyncllm.default_model import default_model_path

        args.model = str(default_model_path())
    engine_args = {"device": "cuda" if args.gpus else "cpu"}
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(deployment(args.model, args.replicas, engine_args, args.gpus), name="asyncllm", route_prefix="/")
    print(f"serving on http://127.0.0.1:{args.port}/v1", flush=True)
    try:
        if args.smoke:
            from openai import OpenAI

            client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            reply = client.chat.completions.create(model="asyncllm", messages=messages, max_tokens=16)  # type: ignore[arg-type]
            print("reply:", reply.choices[0].message.content)
            return
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()


if __name__ == "__main__":
    main()
