"""ASYNCLLM_CUDA_GRAPH_SAMPLING on against off, in one process: decode steps whose LM head, plain draw and latest-token
record replay inside CUDA graphs against the same graphs with the LM head and sampler launched eagerly after.

Per mode, one engine after the other on random weights of the real shape: W5 (batch-1 decode, temperature 0.6,
128 prompt tokens, ms per output token, best of 3), a batch of `--batch` seeded temperature requests decoding
together (ms per decode step), start-up and its capture phase (the draw graphs are one small capture per
decode batch size), and the tokens of the batch (the two modes must give the same ids). "off" runs first: it
pays the process's first engine (Triton compiles, cuBLAS set-up), so "on"'s start-up is not charged for them.
A last line gives the ratios on/off and whether the tokens matched.

Usage (CUDA, ~60 s for the 0.6B): python3 bench/w5_graph_sampling.py [--shape qwen3-0.6b] [--batch 32]
[--w5-tokens 512] [--engine-arg NAME=VALUE]; a CPU smoke run (graphs are CUDA-only: both modes run eagerly):
python bench/w5_graph_sampling.py --shape qwen3-tiny --device cpu --w5-tokens 4 --batch 3 --engine-arg dtype=float32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from random import Random
from typing import Any

from engine_args import add_engine_arg_option, engine_kwargs, free_device_memory, tuning_env
from gemma3_w1_w5 import run_w5
from shapes import SHAPES, write_shape_dir

from asyncllm import LLM, SamplingParams


def measure(args: argparse.Namespace, model_dir: Path, on: bool) -> tuple[dict[str, Any], list[list[int]]]:
    kwargs: dict[str, Any] = dict(max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks)
    kwargs |= engine_kwargs(args.engine_arg)
    start = time.perf_counter()
    with tuning_env(cuda_graph_sampling=on):
        llm = LLM(str(model_dir), device=args.device, load_format="dummy", **kwargs)
    startup = time.perf_counter() - start
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        w5 = run_w5(llm, args.w5_tokens)
        rng = Random(2)
        prompts = [[rng.randint(0, 10000) for _ in range(64)] for _ in range(args.batch)]
        params = [
            SamplingParams(temperature=0.7, seed=i, max_tokens=args.batch_tokens, ignore_eos=True)
            for i in range(args.batch)
        ]
        one = [SamplingParams(temperature=0.7, seed=i, max_tokens=1, ignore_eos=True) for i in range(args.batch)]
        t = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        step_ms = (time.perf_counter() - t - prefill) / (args.batch_tokens - 1) * 1e3
        row = {
            "cuda_graph_sampling": on,
            "w5_ms_per_token": w5["ms_per_token"],
            f"batch{args.batch}_ms_per_step": round(step_ms, 3),
            "startup_s": round(startup, 2),
            "capture_s": round(dict(llm.runtime.startup_seconds).get("capture", 0.0), 3),
        }
        return row, [o.token_ids for o in out]
    finally:
        llm.shutdown()
        del llm
        free_device_memory()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--w5-tokens", type=int, default=512, help="decode tokens timed for W5")
    ap.add_argument("--batch", type=int, default=32, help="requests decoding together")
    ap.add_argument("--batch-tokens", type=int, default=128, help="tokens each of them decodes")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-kv-blocks", type=int, default=1024, help="fixed: engines follow each other in one process")
    add_engine_arg_option(ap)
    args = ap.parse_args(argv)
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    rows, tokens = [], []
    for on in (False, True):
        row, ids = measure(args, model_dir, on)
        row = {"workload": "W5 graph sampling", "shape": args.shape, **row}
        rows.append(row)
        tokens.append(ids)
        print(json.dumps(row), flush=True)
    off_row, on_row = rows
    summary = {
        "workload": "w5_graph_sampling_on_vs_off",
        "shape": args.shape,
        "w5_ms_ratio": round(on_row["w5_ms_per_token"] / off_row["w5_ms_per_token"], 3),
        f"batch{args.batch}_ms_ratio": round(
            on_row[f"batch{args.batch}_ms_per_step"] / off_row[f"batch{args.batch}_ms_per_step"], 3
        ),
        "startup_s_more": round(on_row["startup_s"] - off_row["startup_s"], 2),
        "capture_s_more": round(on_row["capture_s"] - off_row["capture_s"], 3),
        "same_tokens": tokens[0] == tokens[1],  # the batch's ids, off against on
    }
    rows.append(summary)
    print(json.dumps(summary), flush=True)
    return rows


if __name__ == "__main__":
    main()
