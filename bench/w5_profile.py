"""Where one batch-1 decode step (W5) goes on the GPU: every kernel of a steady step, with its count and time,
the step's GPU busy time against its wall time, and the idle between kernels (launch latency inside the graph
and the host's work between graphs). Issue 25's 0.8 ms target needs this split: a step bound by its kernels'
own time wants fused kernels; one bound by the gaps between them wants fewer launches.

Runs W5's request (128 prompt tokens, `--tokens` decode tokens, temperature 0.6, ignore_eos) once for the wall
time, then again under torch.profiler (CUPTI reports the kernels inside CUDA-graph replays), and divides by the
decode steps. Prints JSON lines: the step summary, then the kernels by time per step.

Usage (device machine, from bench/): python3 w5_profile.py [--shape qwen3-0.6b] [--engine-arg NAME=VALUE]
CPU smoke: python bench/w5_profile.py --shape qwen3-tiny --device cpu --tokens 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from engine_args import add_engine_arg_option, engine_kwargs
from gpu_timeline import categorize, summarize
from shapes import SHAPES, write_shape_dir
from torch.profiler import ProfilerActivity, profile
from w1_profile import device_intervals

from asyncllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens per run")
    ap.add_argument("--rows", type=int, default=40, help="kernels listed")
    add_engine_arg_option(ap)
    args = ap.parse_args()
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    llm = LLM(
        str(model_dir), device=args.device, load_format="dummy", max_model_len=4096, **engine_kwargs(args.engine_arg)
    )
    prompt = [[(7 * i) % 10000 for i in range(128)]]

    def run(tokens: int) -> float:
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=tokens), use_tqdm=False)
        return time.perf_counter() - t

    run(8)  # warm
    one = min(run(1) for _ in range(3))
    wall = min(run(args.tokens + 1) for _ in range(3))
    ms_per_token = (wall - one) / args.tokens * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        run(args.tokens + 1)
    timeline = summarize(device_intervals(prof.events()))
    steps = args.tokens  # the prefill step's kernels are a small share at 128 prompt tokens: counted as a step
    head = {"workload": "W5 profile", "shape": args.shape, "engine_args": args.engine_arg}
    print(
        json.dumps(
            head
            | {
                "ms_per_token": round(ms_per_token, 3),
                "kernels_per_step": round(timeline.num_events / (steps + 1), 1),
                "gpu_kernel_sum_us_per_step": round(timeline.kernel_sum_us / (steps + 1), 1),
                "gpu_busy_us_per_step": round(timeline.busy_us / (steps + 1), 1),
                "gpu_idle_us_per_step": round((timeline.span_us - timeline.busy_us) / (steps + 1), 1),
                "gpu_span_us_per_step": round(timeline.span_us / (steps + 1), 1),
            }
        ),
        flush=True,
    )
    top = sorted(timeline.by_name.items(), key=lambda kv: -kv[1][0])
    for name, (us, n) in top[: args.rows]:
        row = {
            "kernel": name[:100],
            "category": categorize(name),
            "per_step": round(n / (steps + 1), 2),
            "us_each": round(us / n, 2),
            "us_per_step": round(us / (steps + 1), 1),
        }
        print(json.dumps(row), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
