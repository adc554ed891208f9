"""Deadlines and cancellation: every way of giving up on a request aborts it and frees its KV blocks.

python examples/cancel.py [MODEL]   # a checkpoint directory or .gguf; default: the built-in SmolLM2
(`asyncio.timeout` needs Python 3.11; on 3.10 use `asyncio.wait_for` as in case 2.)
"""

from __future__ import annotations

import asyncio
import sys

from asyncllm import AsyncLLMEngine, SamplingParams

LONG = SamplingParams(temperature=0.7, ignore_eos=True)  # no max_tokens: runs to max_model_len unless stopped


def model_path() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    try:
        from asyncllm.default_model import default_model_path

        return str(default_model_path())
    except (ImportError, FileNotFoundError) as error:
        sys.exit(f"usage: python {sys.argv[0]} MODEL_PATH\n{error}")


async def main() -> None:
    async with AsyncLLMEngine(model_path()) as engine:
        received = 0
        try:  # 1. a deadline around a stream: leaving the `async for` aborts the request
            async with asyncio.timeout(0.2):
                async for chunk in engine.stream("Tell me a long story.", LONG):
                    received += len(chunk.token_ids)
        except TimeoutError:
            print(f"timeout: stopped after {received} tokens")

        try:  # 2. a deadline around a whole generate()
            await asyncio.wait_for(engine.generate("Another long story.", LONG), timeout=0.2)
        except TimeoutError:
            print("wait_for: gave up")

        task = asyncio.create_task(engine.generate("A third story.", LONG))  # 3. cancel a task
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        print("task cancelled:", task.cancelled())

        stream = engine.stream("A fourth story.", LONG, request_id="story-4")  # 4. abort by id
        await engine.abort("story-4")
        chunks = [chunk async for chunk in stream]
        print("aborted by id, finish_reason:", chunks[-1].finish_reason)

        await asyncio.sleep(0.1)  # aborts are applied by the step thread within one step
        stats = engine.stats()
        print(f"running={stats['num_running']} free blocks {stats['num_free_blocks']}/{stats['num_total_blocks']}")


if __name__ == "__main__":
    asyncio.run(main())
