"""W5 and W1 (../shared/PERF.md) on Gemma 3 4B's shape, random weights: batch-1 decode latency (128 prompt
tokens, 512 timed output tokens, best of 3, the one-token run subtracted) and nano-vllm's offline benchmark
(256 requests, w1_throughput.py's). One JSON line each, with the limit beside it, counted here in bytes:

- W5: each decode step reads every weight once (34 layers of 94.4M parameters and the 262k x 2560 tied LM
  head: 7.76 GB in bfloat16) at the H200's 4.25 TB/s: 1.83 ms per token (the KV read is ~1 % of it).
- W1: the same weight read once per decode step (as many steps as the longest output, every request running
  at once), plus each output token's KV read: 4 KiB per key and layer, every key in the 5 global layers, at
  most 1,024 in the 29 sliding ones. About 24,500 output tok/s; two thirds of the bytes are KV.

Usage (CUDA): python3 bench/gemma3_w1_w5.py [--skip-w1] [--engine-arg NAME=VALUE ...]; on CPU, a smoke run:
--shape gemma3-tiny --device cpu --num-seqs 2 --w5-tokens 4 --max-tokens-cap 4.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from random import Random
from typing import Any

from engine_args import add_engine_arg_option, engine_kwargs
from shapes import SHAPES, write_shape_dir
from w1_throughput import cap_outputs, run_w1, w1_requests

from asyncllm import LLM, SamplingParams

BANDWIDTH = 4.25e12  # bytes/s, the H200's measured copy bandwidth (PERF.md)
BYTES = 2  # bfloat16


def weight_bytes(cfg: dict[str, Any]) -> int:
    """Bytes of weights one decode step reads: every layer's projections and the LM head (norms are noise)."""
    hidden, heads, kv_heads, head_dim = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    mlp = 3 * hidden * cfg["intermediate_size"]
    return BYTES * (cfg["num_hidden_layers"] * (attn + mlp) + cfg["vocab_size"] * hidden)


def kv_bytes_read(cfg: dict[str, Any], num_keys: int) -> int:
    """KV bytes one decode token reads at `num_keys` keys: all of them in global layers, the window in sliding
    ones (every `sliding_window_pattern`-th layer is global)."""
    per_key = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * BYTES  # k and v, one layer
    layers, pattern = cfg["num_hidden_layers"], cfg["sliding_window_pattern"]
    num_global = layers // pattern
    return per_key * (num_global * num_keys + (layers - num_global) * min(num_keys, cfg["sliding_window"]))


def w5_limit_ms(cfg: dict[str, Any]) -> float:
    return weight_bytes(cfg) / BANDWIDTH * 1e3


def w1_limit(cfg: dict[str, Any], prompt_lens: list[int], output_lens: list[int]) -> float:
    """Output tokens per second if every decode step were bound by its reads (every request running at once)."""
    total = max(output_lens) * weight_bytes(cfg)
    total += sum(kv_bytes_read(cfg, p + t) for p, n in zip(prompt_lens, output_lens) for t in range(n))
    return sum(output_lens) / (total / BANDWIDTH)


def run_w5(llm: LLM, tokens: int) -> dict[str, float]:
    prompt = [[Random(1).randint(0, 10000) for _ in range(128)]]
    best = {}
    for n in (1, tokens + 1):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n), use_tqdm=False)
            times.append(time.perf_counter() - t)
        best[n] = min(times)
    return {"ms_per_token": round((best[tokens + 1] - best[1]) / tokens * 1e3, 3), "ttft_ms": round(best[1] * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma3-4b", choices=[s for s in SHAPES if s.startswith("gemma3")])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--w5-tokens", type=int, default=512, help="decode tokens timed for W5")
    ap.add_argument("--max-tokens-cap", type=int, default=None, help="cap W1's output lengths (smoke runs)")
    ap.add_argument("--skip-w1", action="store_true")
    ap.add_argument("--skip-w5", action="store_true")
    add_engine_arg_option(ap)
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    extra = engine_kwargs(args.engine_arg)
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        device=args.device,
        load_format="dummy",
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        **extra,
    )
    base = {
        "shape": args.shape,
        "kv_blocks": llm.runtime.num_kv_blocks,
        "startup_s": round(time.perf_counter() - start, 1),
    }
    if extra:
        base["engine_args"] = extra
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
    if not args.skip_w5:
        w5 = run_w5(llm, args.w5_tokens)
        limit = w5_limit_ms(cfg)
        w5 |= {"limit_ms_per_token": round(limit, 3), "percent_of_limit": round(100 * limit / w5["ms_per_token"], 1)}
        print(json.dumps({"workload": "W5", **base, **w5}), flush=True)
    if not args.skip_w1:
        prompts, params = w1_requests(args.num_seqs)
        params = cap_outputs(params, args.max_tokens_cap)
        run = run_w1(llm, prompts, params)
        tps = run.output_tokens / run.seconds
        limit = w1_limit(cfg, [len(p) for p in prompts], [p.max_tokens or 0 for p in params])
        w1 = {"output_tokens": run.output_tokens, "seconds": round(run.seconds, 2), "output_tok_per_s": round(tps, 1)}
        w1 |= {"limit_tok_per_s": round(limit), "percent_of_limit": round(100 * tps / limit, 1)}
        w1 |= {"preemptions": llm.stats()["num_preemptions"], "steps": run.steps}
        print(json.dumps({"workload": "W1", **base, **w1}), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
