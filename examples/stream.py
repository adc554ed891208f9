"""Stream answers with `async for`: one printed as it is generated, then three at once on one engine.

python examples/stream.py [MODEL]   # a checkpoint directory or .gguf; default: the built-in SmolLM2
"""

from __future__ import annotations

import asyncio
import sys

from asyncllm import AsyncLLMEngine, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=48)


def model_path() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    try:
        from asyncllm.default_model import default_model_path

        return str(default_model_path())
    except (ImportError, FileNotFoundError) as error:
        sys.exit(f"usage: python {sys.argv[0]} MODEL_PATH\n{error}")


async def answer(engine: AsyncLLMEngine, question: str) -> str:
    prompt = engine.apply_chat_template([{"role": "user", "content": question}])
    parts = []
    async for chunk in engine.stream(prompt, PARAMS):  # chunk.text: what is new since the last chunk
        parts.append(chunk.text)
        if chunk.finished:
            ttft_ms = chunk.metrics.time_to_first_token * 1e3
            print(f"[{question}] {chunk.metrics.num_generated_tokens} tokens, first after {ttft_ms:.0f} ms")
    return "".join(parts)


async def main() -> None:
    async with AsyncLLMEngine(model_path()) as engine:
        prompt = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        async for chunk in engine.stream(prompt, PARAMS):
            print(chunk.text, end="", flush=True)
        print()
        questions = ["Name a colour.", "Count to five.", "Say hello in Japanese."]
        for question, text in zip(questions, await asyncio.gather(*(answer(engine, q) for q in questions))):
            print(f"{question} -> {text!r}")
        print("stats:", engine.stats())


if __name__ == "__main__":
    asyncio.run(main())
