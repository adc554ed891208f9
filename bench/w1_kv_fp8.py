"""The FP8 KV cache (kv_cache_dtype="fp8") against the model-dtype one ("auto"): W1 (bench/w1_throughput.py's 256
requests, prompts U[100, 1024], outputs U[100, 1024], temperature 0.6, ignore_eos) and W5 (batch-1 decode: 128
prompt tokens, the tokens after the first timed, best of 3), random weights of the real shape.

W1 decode is where the FP8 cache should pay: at 256 running sequences of ~1,000 keys, one Qwen3-0.6B decode step
reads ~29 GB of bf16 keys and values (28 layers x 8 KV heads x 128 dims x 2 tensors x 2 bytes a key) against
1.2 GB of weights, so attention's reads bound the step and e4m3 halves them. W5 reads the weights and a few
hundred keys: the FP8 cache should change nothing there (what it costs: the conversion in the kernels).

Each run in a process of its own (the device's memory whole for each). Prints one JSON line per workload and
cache, then one with the ratios (fp8 / auto: W1 tokens/s, W5 ms a token) and each W1 run's bound from bytes
read (weights once a step, plus each output token's keys and values) at the H200's 4.25 TB/s.

Usage (CUDA): python3 bench/w1_kv_fp8.py [--shape qwen3-0.6b] [--rounds 1] [--skip-w5] [--engine-arg NAME=VALUE];
on CPU, a smoke run: --shape qwen3-tiny --device cpu --num-seqs 4 --max-tokens 4 --w5-tokens 4.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine_args import run_child
from gemma3_w1_w5 import run_w5
from shapes import SHAPES
from w1_throughput import add_w1_arguments, cap_outputs, run_w1, w1_engine, w1_requests

BANDWIDTH = 4.25e12  # bytes/s, the H200's measured copy bandwidth
KINDS = ("auto", "fp8")


def weight_bytes(cfg: dict[str, Any]) -> int:
    """Bytes one decode step reads in bf16 weights: every layer's projections and the LM head."""
    hidden, heads, kv_heads, head_dim = (cfg[k] for k in ("hidden_size", "num_attention_heads",
                                                          "num_key_value_heads", "head_dim"))  # fmt: skip
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return 2 * (cfg["num_hidden_layers"] * (attn + 3 * hidden * cfg["intermediate_size"]) + cfg["vocab_size"] * hidden)


def w1_bound(cfg: dict[str, Any], prompt_lens: list[int], output_lens: list[int], kv_bytes: int) -> float:
    """Output tokens/s if every step were bound by its reads (all requests running at once): the weights once a
    step, and each output token's keys and values at `kv_bytes` an element (every layer attends globally)."""
    per_key = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * kv_bytes
    keys = sum(n * p + n * (n + 1) // 2 for p, n in zip(prompt_lens, output_lens))  # sum over t of (p + t)
    total = max(output_lens) * weight_bytes(cfg) + per_key * keys
    return sum(output_lens) / (total / BANDWIDTH)


def measure(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """W1 (the fastest of `args.rounds` runs) and W5 on one engine whose cache is `kind`."""
    llm = w1_engine(args, kv_cache_dtype=kind)
    try:
        prompts, params = w1_requests(args.num_seqs)
        params = cap_outputs(params, args.max_tokens)
        runs = [run_w1(llm, prompts, params) for _ in range(args.rounds)]
        best = min(runs, key=lambda r: r.seconds)
        cfg, runtime = SHAPES[args.shape], llm.runtime
        per_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * runtime.block_size
        kv_bytes = runtime.kv_cache_bytes // (runtime.num_kv_blocks * per_block)  # 2 in bfloat16, 1 in e4m3
        bound = w1_bound(cfg, [len(p) for p in prompts], [p.max_tokens or 0 for p in params], kv_bytes)
        out: dict[str, Any] = {
            "kv_cache_dtype": kind,
            "w1_tok_s": round(best.output_tokens / best.seconds, 1),
            "w1_seconds": round(best.seconds, 2),
            "w1_output_tokens": best.output_tokens,
            "w1_steps": best.steps,
            "w1_bound_tok_s": round(bound),
            "preemptions": llm.stats()["num_preemptions"],
            "kv_blocks": llm.runtime.num_kv_blocks,
            "kv_cache_gib": round(llm.runtime.kv_cache_bytes / 2**30, 2),
        }
        if not args.skip_w5:
            w5 = run_w5(llm, args.w5_tokens)
            out |= {"w5_ms_per_token": w5["ms_per_token"], "w5_ttft_ms": w5["ttft_ms"]}
    finally:
        llm.shutdown()
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_w1_arguments(ap)
    ap.add_argument("--rounds", type=int, default=1, help="timed W1 runs per cache; the fastest counts")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every W1 output's length (smoke runs)")
    ap.add_argument("--w5-tokens", type=int, default=512, help="decode tokens timed for W5")
    ap.add_argument("--skip-w5", action="store_true")
    ap.add_argument("--child", choices=KINDS, default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.child is not None:
        print(json.dumps(measure(args, args.child)))
        return
    results = {}
    for kind in KINDS:
        results[kind] = run_child(__file__, kind)
        print(json.dumps({"workload": "W1+W5", "shape": args.shape, **results[kind]}), flush=True)
    auto, fp8 = results["auto"], results["fp8"]
    summary: dict[str, Any] = {"workload": "kv_fp8_vs_auto", "shape": args.shape, "requests": args.num_seqs}
    summary["w1_tok_s_ratio"] = round(fp8["w1_tok_s"] / auto["w1_tok_s"], 3)
    summary["w1_bound_ratio"] = round(fp8["w1_bound_tok_s"] / auto["w1_bound_tok_s"], 3)
    summary["kv_blocks_ratio"] = round(fp8["kv_blocks"] / auto["kv_blocks"], 3)
    if not args.skip_w5:
        summary["w5_ms_ratio"] = round(fp8["w5_ms_per_token"] / auto["w5_ms_per_token"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
