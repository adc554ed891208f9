"""Start-up cost and the first request: load, memory profile, warm-up and CUDA-graph capture times, then
the time to first token of the first request in this process against a warm one (target: within 2x).
Random weights of a real shape (load_format="dummy"). Prints one JSON line.
`--profile N`: also cProfile the construction and print its top N functions, by cumulative and by own time, after
the JSON line (where a phase's seconds go: first kernel loads, cuBLAS set-up, captures).
`--graph-detail`: also log each CUDA graph's capture (staging, eager run, recording) as it happens.
Usage (device machine, from bench/): python3 startup.py [--shape qwen3-0.6b] [--enforce-eager] [--profile 40]
[--graph-detail]"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from shapes import write_shape_dir

from asyncllm import LLM, SamplingParams
from asyncllm.console import configure_logging


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the construction's top N functions")
    ap.add_argument("--graph-detail", action="store_true", help="log each CUDA graph's capture phases")
    args = ap.parse_args()
    configure_logging("info")  # the set-up's log lines (the graphs' capture breakdown) beside the JSON line
    if args.graph_detail:
        logging.getLogger("asyncllm.worker.cuda_graph").setLevel(logging.DEBUG)
    profiler = cProfile.Profile() if args.profile else None
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    llm = LLM(
        str(model_dir),
        device="cuda",
        load_format="dummy",
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
    )
    built = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    params = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)
    prompt = list(range(1000, 1128))

    def ttft() -> float:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.metrics is not None and out.metrics.time_to_first_token is not None
        return out.metrics.time_to_first_token

    first = ttft()
    warm = statistics.median(ttft() for _ in range(5))
    print(
        json.dumps(
            {
                "workload": "startup",
                "shape": args.shape,
                "enforce_eager": args.enforce_eager,
                "construct_s": round(built, 2),
                "steps_s": {k: round(v, 2) for k, v in llm.runtime.startup_seconds},
                "cuda_graph_sizes": len(llm.runtime.cuda_graph_sizes),
                "first_ttft_ms": round(first * 1e3, 2),
                "warm_ttft_ms": round(warm * 1e3, 2),
                "first_over_warm": round(first / warm, 2),
            }
        )
    )
    if profiler is not None:
        for order in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(args.profile)
            print(f"---- construction, by {order} time\n{text.getvalue()}")


if __name__ == "__main__":
    main()
