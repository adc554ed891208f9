"""W1 (../shared/PERF.md): offline throughput, nano-vllm's benchmark. 256 requests, seed 0, prompt lengths
U[100, 1024] of ids < 10000, output lengths U[100, 1024], temperature 0.6, ignore_eos. Random weights of the
real shape. Prints one JSON line with output tok/s and its percent of the H200 limit."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from engine_args import add_engine_arg_option, engine_kwargs
from host_timing import host_timing
from shapes import W1_LIMIT, write_shape_dir
from triton_compiles import triton_compiles

from asyncllm import LLM, SamplingParams


def w1_requests(num_seqs: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)  # the same draws, in the same order, as nano-vllm's bench.py
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024)) for _ in range(num_seqs)
    ]
    return prompts, params


def cap_outputs(params: list[SamplingParams], cap: int | None) -> list[SamplingParams]:
    """`params` with every output length capped at `cap` (None: unchanged): smoke runs, admission profiles."""
    if cap is None:
        return params
    return [dataclasses.replace(p, max_tokens=min(p.max_tokens or cap, cap)) for p in params]


@dataclasses.dataclass(frozen=True)
class RunResult:
    seconds: float
    output_tokens: int
    steps: int


def run_w1(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> RunResult:
    """One timed `generate` of the W1 requests: wall seconds, output tokens, engine steps."""
    steps0 = llm.stats()["num_steps"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return RunResult(seconds, sum(len(o.token_ids) for o in outs), int(llm.stats()["num_steps"] - steps0))


def add_w1_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every W1 script takes: the shape, the request count and the engine's."""
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    add_engine_arg_option(ap)


def w1_engine(args: argparse.Namespace, **overrides: Any) -> LLM:
    """An LLM on random weights of `args.shape`, warmed up, with the options of `add_w1_arguments`."""
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    kwargs = {"max_model_len": args.max_model_len, "attention_backend": args.attention_backend}
    kwargs |= engine_kwargs(args.engine_arg) | overrides
    llm = LLM(str(model_dir), device=args.device, load_format="dummy", **kwargs)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    return llm


def main() -> None:
    ap = argparse.ArgumentParser()
    add_w1_arguments(ap)
    ap.add_argument("--host-timing", action="store_true", help="the step thread's time per step, by phase")
    args = ap.parse_args()
    extra = engine_kwargs(args.engine_arg)
    llm = w1_engine(args)
    prompts, params = w1_requests(args.num_seqs)
    with triton_compiles() as compiles, host_timing() if args.host_timing else nullcontext() as timing:
        run = run_w1(llm, prompts, params)
    n_out, seconds = run.output_tokens, run.seconds
    tps = n_out / seconds
    limit = W1_LIMIT.get(args.shape)
    print(
        json.dumps(
            {
                "workload": "W1",
                "shape": args.shape,
                "attention_backend": args.attention_backend,
                "requests": len(prompts),
                "output_tokens": n_out,
                "seconds": round(seconds, 2),
                "output_tok_per_s": round(tps, 1),
                "limit_tok_per_s": limit,
                "percent_of_limit": round(100 * tps / limit, 1) if limit else None,
                "kv_blocks": llm.runtime.num_kv_blocks,
                "preemptions": llm.stats()["num_preemptions"],
                "engine_args": extra,
                "triton_compiles_after_warmup": dict(compiles),
                **(timing.summary() if timing is not None else {}),
            }
        )
    )


if __name__ == "__main__":
    main()
