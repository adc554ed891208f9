"""Stream one chat answer token by token through the model's chat template.

python examples/chat.py [MODEL] [-q QUESTION]   # MODEL: a checkpoint directory or .gguf; default: SmolLM2
(install the default model once with `asyncllm fetch-model`)
"""

from __future__ import annotations

import argparse
import asyncio

from asyncllm import AsyncLLMEngine, SamplingParams
from asyncllm.default_model import default_model_path


async def main(model: str, question: str) -> None:
    async with AsyncLLMEngine(model, device="auto") as engine:
        prompt = engine.apply_chat_template([{"role": "user", "content": question}])  # token ids
        async for chunk in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=64)):
            print(chunk.text, end="", flush=True)
        print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="checkpoint directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("-q", "--question", default="What is the capital of France?")
    args = parser.parse_args()
    asyncio.run(main(args.model or str(default_model_path()), args.question))
