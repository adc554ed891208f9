"""Tensor parallelism: TP=1 against TP=2 on Qwen3-8B's shape (random weights, real tokenizer), in one call.

Per size, in a child process of its own (each starts from clean GPUs): W5, batch-1 decode latency (a
128-token prompt; ms per output token = (time for 513 tokens - time for 1) / 512, best of 3, as
../shared/peers/w1_w5.py measures it), then W1, the 256-request offline workload of bench/w1_throughput.py.
Prints a JSON line per (size, workload), then one with the ratios against the issue's targets: W5 at TP=2
<= 0.6x TP=1, W1 at TP=2 >= 1.6x TP=1.

Device machine (2 GPUs; keep NCCL_NVLS_ENABLE=0): python bench/tp_bench.py [--shape qwen3-8b] [--tp 1 2]
    [--skip-w1] [--attention-backend auto] [--w5-tokens 512] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from random import Random
from typing import Any

from engine_args import add_engine_arg_option

HERE = Path(__file__).resolve().parent


def run_size(args: argparse.Namespace) -> None:
    """The child: one engine of `args.child` ranks, W5 then W1."""
    sys.path.insert(0, str(HERE))
    from engine_args import engine_kwargs
    from shapes import W1_LIMIT, write_shape_dir
    from w1_throughput import run_w1, w1_requests

    from asyncllm import LLM, SamplingParams

    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        device=args.device,
        load_format="dummy",
        max_model_len=4096,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.child,
        **engine_kwargs(args.engine_arg),
    )
    base = {"shape": args.shape, "tp": args.child, "kv_blocks": llm.runtime.num_kv_blocks}
    if args.engine_arg:
        base["engine_args"] = args.engine_arg  # as given: tuning variables' pairs too
    base["startup_s"] = round(time.perf_counter() - start, 1)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
    rng = Random(1)
    prompt = [[rng.randint(0, 10000) for _ in range(128)]]
    best = {}
    long = args.w5_tokens + 1
    for n in (1, long):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n), use_tqdm=False)
            times.append(time.perf_counter() - t)
        best[n] = min(times)
    ms = (best[long] - best[1]) / args.w5_tokens * 1000
    print(json.dumps({"workload": "W5", **base, "ms_per_token": round(ms, 3), "ttft_ms": round(best[1] * 1e3, 2)}))
    if not args.skip_w1:
        run = run_w1(llm, *w1_requests(256))
        tps = run.output_tokens / run.seconds
        limit = W1_LIMIT.get(args.shape)
        w1 = {"output_tokens": run.output_tokens, "seconds": round(run.seconds, 2), "output_tok_per_s": round(tps, 1)}
        w1["percent_of_1gpu_limit"] = round(100 * tps / limit, 1) if limit else None
        print(json.dumps({"workload": "W1", **base, **w1, "preemptions": llm.stats()["num_preemptions"]}))
    sys.stdout.flush()
    llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--skip-w1", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself")
    ap.add_argument("--w5-tokens", type=int, default=512, help="decode tokens timed for W5")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    add_engine_arg_option(ap)
    args = ap.parse_args()
    if args.child is not None:
        run_size(args)
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    results: dict[tuple[int, str], dict[str, Any]] = {}
    for size in args.tp:
        cmd = [sys.executable, __file__, "--child", str(size), "--shape", args.shape]
        cmd += ["--attention-backend", args.attention_backend, "--device", args.device]
        cmd += ["--w5-tokens", str(args.w5_tokens)] + (["--skip-w1"] if args.skip_w1 else [])
        cmd += [f"--engine-arg={pair}" for pair in args.engine_arg]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                results[(size, row["workload"])] = row
                print(line, flush=True)
        if proc.returncode:
            print(json.dumps({"tp": size, "error": f"child exited with {proc.returncode}"}), flush=True)
    summary: dict[str, Any] = {"summary": "tp_bench", "shape": args.shape}
    w5 = [results.get((s, "W5")) for s in (1, 2)]
    if w5[0] and w5[1]:
        ratio = w5[1]["ms_per_token"] / w5[0]["ms_per_token"]
        summary.update(w5_tp2_over_tp1=round(ratio, 3), w5_target="<= 0.6", w5_met=0 < ratio <= 0.6)
    w1 = [results.get((s, "W1")) for s in (1, 2)]
    if w1[0] and w1[1]:
        ratio = w1[1]["output_tok_per_s"] / w1[0]["output_tok_per_s"]
        summary.update(w1_tp2_over_tp1=round(ratio, 3), w1_target=">= 1.6", w1_met=ratio >= 1.6)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
