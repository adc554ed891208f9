"""Which Python functions the host spends a W1 run's steps in: cProfile over `LLM.generate` (the step loop
runs in the calling thread), top functions by own time and by cumulative time.

`--max-tokens-cap N` caps every request's output, so a small N profiles the admission steps (each carries
8,192 prompt tokens at the defaults) with few decode steps after them. The device's own time does not show
here except as time spent waiting (`result`/`synchronize` frames): read it against `--host-timing`.

    python3 host_profile.py --max-tokens-cap 2 --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from w1_throughput import add_w1_arguments, cap_outputs, run_w1, w1_engine, w1_requests


def main() -> None:
    ap = argparse.ArgumentParser()
    add_w1_arguments(ap)
    ap.add_argument("--max-tokens-cap", type=int, default=None, help="cap each request's output length")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    llm = w1_engine(args)
    prompts, params = w1_requests(args.num_seqs)
    params = cap_outputs(params, args.max_tokens_cap)
    profile = cProfile.Profile()
    profile.enable()
    run = run_w1(llm, prompts, params)
    profile.disable()
    print(f"# {run.steps} steps, {run.output_tokens} output tokens, {run.seconds:.3f} s under the profiler")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(args.top)
        body = text.getvalue()
        print(f"# by {key}\n" + body[body.index("   ncalls") :])


if __name__ == "__main__":
    main()
