"""W8: what scoring a prompt costs (`SamplingParams(prompt_logprobs=k)`, the server's `echo` with `logprobs`,
as evaluation harnesses ask it). Qwen3-0.6B shape, random weights. Batches of fresh prompts (the prefix cache
never hits), one output token each (an evaluation's `max_tokens=1`), prefilled with prompt_logprobs None, 0
and 5: prompt tokens per second, best of `--repeats`, and its ratio to the unscored run. The scored run adds
the LM head over every prompt row (in slices of max_num_seqs rows) and a log_softmax over the vocabulary per
row, so its cost grows with vocab x prompt tokens; the unscored run must be where it was before the feature.
Prints one JSON line per setting, then one with the ratios.

Usage (device machine, from bench/): python3 w8_prompt_logprobs.py [--shape qwen3-0.6b]
CPU smoke: python bench/w8_prompt_logprobs.py --shape qwen3-tiny --device cpu --prompts 4 --length 64 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from shapes import write_shape_dir

from asyncllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    rng = random.Random(0)
    llm = LLM(str(model_dir), device=args.device, load_format="dummy", max_model_len=args.length + 8)

    def fresh() -> list[list[int]]:
        return [[rng.randrange(10000) for _ in range(args.length)] for _ in range(args.prompts)]

    settings: dict[str, int | None] = {"none": None, "k0": 0, "k5": 5}
    for k in settings.values():  # warm-up: every path once
        llm.generate(fresh()[:2], SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    rates: dict[str, float] = {}
    for name, k in settings.items():
        params = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=k)
        best = float("inf")
        for _ in range(args.repeats):
            prompts = fresh()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
            assert all((o.prompt_logprobs is None) == (k is None) for o in outs)
        rates[name] = args.prompts * args.length / best
        row = {"workload": "W8", "shape": args.shape, "device": args.device, "prompt_logprobs": k}
        print(json.dumps(row | {"prompts": args.prompts, "length": args.length, "tok_per_s": round(rates[name])}))
    ratios = {name: round(rate / rates["none"], 3) for name, rate in rates.items()}
    print(json.dumps({"workload": "W8", "shape": args.shape, "device": args.device, "over_unscored": ratios}))
    llm.shutdown()


if __name__ == "__main__":
    main()
