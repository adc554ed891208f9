"""What streaming costs: the same greedy requests through offline `LLM.generate` and through concurrent
`async for` streams on `AsyncLLMEngine` (step thread + per-loop fan-out + merge-on-put).

Prints one JSON line: both throughputs and their ratio, client-side time to first token and inter-token
latency (p50/p99), and whether both paths produced identical tokens. Default model: the tests' tiny Qwen3
checkpoint, built into a temp dir (CPU).

python bench/stream_overhead.py [--model DIR] [--num-seqs 64] [--max-tokens 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncllm import LLM, AsyncLLMEngine, SamplingParams


def requests(num_seqs: int, max_tokens: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], SamplingParams]:
    """Seed 1 warms up; seed 0 is timed (fresh prompts: no prefix-cache hits from the warm-up)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(num_seqs)]
    return prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run_offline(model: str, engine_args: dict[str, Any], num_seqs: int, max_tokens: int) -> dict[str, Any]:
    llm = LLM(model, **engine_args)
    warm, params = requests(num_seqs, max_tokens, llm.runtime.vocab_size, seed=1)
    llm.generate(warm, params, use_tqdm=False)  # warm-up: the first batches of a shape are much slower
    prompts, params = requests(num_seqs, max_tokens, llm.runtime.vocab_size)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    llm.shutdown()
    return {"seconds": seconds, "tokens": [o.token_ids for o in outs]}


async def run_streams(model: str, engine_args: dict[str, Any], num_seqs: int, max_tokens: int) -> dict[str, Any]:
    async with AsyncLLMEngine(model, **engine_args) as engine:
        warm, params = requests(num_seqs, max_tokens, engine.runtime.vocab_size, seed=1)
        await asyncio.gather(*(engine.generate(p, params) for p in warm))  # warm-up, as offline
        prompts, params = requests(num_seqs, max_tokens, engine.runtime.vocab_size)
        ttft: list[float] = []
        itl: list[float] = []  # per token: the gap between chunks, shared by the tokens a chunk carries
        chunks_seen = 0

        async def one(prompt: list[int]) -> list[int]:
            nonlocal chunks_seen
            start = last = time.perf_counter()
            tokens: list[int] = []
            async for chunk in engine.stream(prompt, params):
                now = time.perf_counter()
                if not tokens:
                    ttft.append(now - start)
                elif chunk.token_ids:
                    itl.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
                tokens.extend(chunk.token_ids)
                chunks_seen += 1
                last = now
            return tokens

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "ttft": ttft, "itl": itl, "chunks": chunks_seen}


def tiny_checkpoint() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fixtures.tiny_models import build_checkpoint

    return str(build_checkpoint(Path(tempfile.mkdtemp()) / "qwen3", "qwen3"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tests' tiny Qwen3, built now)")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    args = ap.parse_args()
    model = args.model or tiny_checkpoint()
    engine_args = dict(device=args.device, num_kv_blocks=args.num_kv_blocks, block_size=16, max_model_len=512)
    offline = run_offline(model, engine_args, args.num_seqs, args.max_tokens)
    streamed = asyncio.run(run_streams(model, engine_args, args.num_seqs, args.max_tokens))
    n_tokens = sum(len(t) for t in streamed["tokens"])
    offline_tps = sum(len(t) for t in offline["tokens"]) / offline["seconds"]
    stream_tps = n_tokens / streamed["seconds"]
    ms = 1e3
    print(
        json.dumps(
            {
                "bench": "stream_overhead",
                "device": args.device,
                "model": "tiny-qwen3" if args.model is None else args.model,
                "requests": args.num_seqs,
                "output_tokens": n_tokens,
                "offline_tok_per_s": round(offline_tps, 1),
                "stream_tok_per_s": round(stream_tps, 1),
                "throughput_ratio": round(stream_tps / offline_tps, 3),
                "ttft_ms_p50": round(pct(streamed["ttft"], 50) * ms, 2),
                "ttft_ms_p99": round(pct(streamed["ttft"], 99) * ms, 2),
                "itl_ms_p50": round(pct(streamed["itl"], 50) * ms, 2),
                "itl_ms_p99": round(pct(streamed["itl"], 99) * ms, 2),
                "tokens_per_chunk": round(n_tokens / streamed["chunks"], 2),
                "identical_outputs": streamed["tokens"] == offline["tokens"],
            }
        )
    )


if __name__ == "__main__":
    main()
