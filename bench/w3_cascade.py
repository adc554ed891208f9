"""W3 (shared prefixes) with cascade decode attention on ("auto") and off, prefix caching on in both: random
weights of the real shape. W3 (../shared/peers/w3_prefix.py's workload, rebuilt here with its seed): `--groups`
groups of 16 requests, each group sharing a 2,048-token prefix plus 128 unique tokens, 256 output tokens each
(temperature 0.6, ignore_eos). With the prefix's KV shared, each decode step still reads the 2,048 shared keys
once per request; cascade reads them once per group.

Each run in a process of its own (the device's memory whole for each). Prints one JSON line per run, then the
ratios: cascade auto / off, and with `--no-caching-too` (a third run, prefix caching off) W3's own metric,
prefix caching on (cascade auto) / off.

Usage (CUDA): python3 bench/w3_cascade.py [--groups 64] [--no-caching-too] [--engine-arg NAME=VALUE];
on CPU, a smoke run: --shape qwen3-tiny --device cpu --groups 2 --prefix 64 --unique 8 --max-tokens 4.
"""

from __future__ import annotations

import argparse
import json
import time
from random import randint, seed
from typing import Any

from engine_args import run_child, tuning_env
from w1_throughput import add_w1_arguments, w1_engine

from asyncllm import SamplingParams

KINDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # run name -> (engine arguments, tuning variables)
    "cascade_auto": ({}, {"cascade_attention": "auto"}),
    "cascade_off": ({}, {"cascade_attention": "off"}),
    "no_prefix_caching": ({"enable_prefix_caching": False}, {"cascade_attention": "off"}),
}


def w3_prompts(groups: int, prefix: int, unique: int, members: int = 16) -> list[list[int]]:
    """The peer script's prompts (its seed and draw order): `groups` x `members`, each group sharing a prefix."""
    seed(3)
    [randint(0, 10000) for _ in range(64)]  # the peer's warm-up prompt, drawn first
    prompts = []
    for _ in range(groups):
        shared = [randint(0, 10000) for _ in range(prefix)]
        prompts += [shared + [randint(0, 10000) for _ in range(unique)] for _ in range(members)]
    return prompts


def measure(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    engine_args, tuning = KINDS[kind]
    built = time.perf_counter()
    with tuning_env(**tuning):  # ASYNCLLM_CASCADE_ATTENTION
        llm = w1_engine(args, **engine_args)
    startup_s = time.perf_counter() - built  # load, tuning, warm-up and graph capture (cascade adds variants)
    try:
        prompts = w3_prompts(args.groups, args.prefix, args.unique)
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.max_tokens)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        return {
            "run": kind,
            "requests": len(prompts),
            "output_tokens": tokens,
            "seconds": round(seconds, 2),
            "tok_s": round(tokens / seconds, 1),
            "startup_s": round(startup_s, 2),
            "cuda_graph_sizes": len(llm.runtime.cuda_graph_sizes),
        }
    finally:
        llm.shutdown()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_w1_arguments(ap)
    ap.add_argument("--groups", type=int, default=64, help="groups of 16 requests sharing a prefix (W3: 64)")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--unique", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--no-caching-too", action="store_true", help="also run prefix caching off (W3's metric)")
    ap.add_argument("--child", choices=list(KINDS), default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.child is not None:
        print(json.dumps(measure(args, args.child)))
        return
    kinds = [k for k in KINDS if args.no_caching_too or k != "no_prefix_caching"]
    results = {}
    for kind in kinds:
        results[kind] = run_child(__file__, kind)
        print(json.dumps({"workload": "W3", "shape": args.shape, **results[kind]}), flush=True)
    summary: dict[str, Any] = {"workload": "W3 cascade", "groups": args.groups}
    summary["cascade_auto_over_off"] = round(results["cascade_auto"]["tok_s"] / results["cascade_off"]["tok_s"], 3)
    if "no_prefix_caching" in results:
        caching = results["cascade_auto"]["tok_s"] / results["no_prefix_caching"]["tok_s"]
        summary["prefix_caching_on_over_off"] = round(caching, 3)  # W3's metric (target >= 2.5)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
