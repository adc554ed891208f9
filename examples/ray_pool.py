"""Two engines on Ray behind the engine's own async API: `ReplicaPool`. The same streams, cancellation and
stats as with one engine. A request goes where its prompt's prefix is cached (here: the chat template's
opening, which every question shares) unless that replica is clearly busier than the other.

python examples/ray_pool.py [MODEL]   # the `ray` extra; joins $RAY_ADDRESS, else starts a local Ray cluster
"""

from __future__ import annotations

import asyncio
import sys

from asyncllm import SamplingParams
from asyncllm.ray import ReplicaPool

PARAMS = SamplingParams(temperature=0.0, max_tokens=32)


def model_path() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    try:
        from asyncllm.default_model import default_model_path

        return str(default_model_path())
    except (ImportError, FileNotFoundError) as error:
        sys.exit(f"usage: python {sys.argv[0]} MODEL_PATH\n{error}")


async def main() -> None:
    # Each replica is a Ray actor holding one engine (a GPU each when the cluster has them; else a CPU each).
    async with ReplicaPool(model_path(), num_replicas=2) as pool:
        prompt = pool.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        async for chunk in pool.stream(prompt, PARAMS):  # streamed from whichever replica took it
            print(chunk.text, end="", flush=True)
        print()

        questions = [f"What is {i} + {i}?" for i in range(24)]
        chats = [pool.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        outs = await asyncio.gather(*(pool.generate(c, PARAMS) for c in chats))  # all at once
        print(f"{questions[-1]} -> {outs[-1].text!r}")

        running = asyncio.Event()

        async def read_to_the_limit() -> None:
            async for _ in pool.stream(chats[0], SamplingParams(ignore_eos=True)):
                running.set()

        endless = asyncio.create_task(read_to_the_limit())
        await running.wait()
        endless.cancel()  # aborts the request in its replica, within a step
        await asyncio.gather(endless, return_exceptions=True)
        print("cancelled:", endless.cancelled())
        while pool.stats()["num_running"]:  # the abort lands in its replica within a step
            await asyncio.sleep(0.01)

        for row in pool.replica_stats():
            free, total, hits = row["num_free_blocks"], row["num_total_blocks"], row["prefix_cache_hit_rate"]
            print(f"replica {row['index']}: steps {row['num_steps']}, prefix hits {hits:.0%}, free {free}/{total}")


if __name__ == "__main__":
    asyncio.run(main())
