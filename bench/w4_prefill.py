"""W4 (../shared/PERF.md): long context. One request at a time, prompts of 16K and 32K random ids, 256 output
tokens, Qwen3-0.6B shape with random weights. Prefill throughput is prompt tokens / TTFT (best of 3 after a
warm-up, each repetition a fresh prompt so the prefix cache never hits); decode is ms per output token after
the first (median). Runs twice: with the default token budget per step (max_num_batched_tokens 8192, so a
32K prompt is prefilled in 4 chunks) and with a budget of the longest prompt (one chunk), to show what
chunking costs. Prints one JSON line per (budget, prompt length), then one comparing the two budgets.

Limits on one H200 (compute-bound prefill at `H200_BF16_FLOPS`; decode reads at `H200_COPY_BYTES_PER_S`):
  prefill FLOPs per token = 2 x (linear-layer parameters, LM head excluded: it runs for the last token only)
                            + 4 x layers x q_heads x head_dim x L / 2   (QK^T and PV, causal: L/2 keys on average)
  Qwen3-0.6B: 2 x 440.4M = 0.881 GFLOP + 229,376 x L / 2  ->  L = 32K: 4.64 GFLOP, L = 16K: 2.76 GFLOP
  (the limits in tok/s these give: bench/RESULTS.md, run 6).
  decode bytes per token = all weights (2 bytes each) + the KV read (L + 128 tokens on average) x KV bytes/token.

Usage (device machine, from bench/): python3 w4_prefill.py [--shape qwen3-0.6b] [--profile]
(--profile: one more prefill of the longest prompt under the profiler, in the one-chunk engine: GEMM and
attention time and the TFLOP/s each reaches, for the prefill kernel's GQA-packing / TMA decision)
CPU smoke: python bench/w4_prefill.py --shape qwen3-tiny --device cpu --lengths 96 200 --output-tokens 8 \
           --budgets 64 256 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from shapes import SHAPES, write_shape_dir

from asyncllm import LLM, SamplingParams

H200_BF16_FLOPS = 790e12  # measured dense bf16 matmul (PERF.md)
H200_COPY_BYTES_PER_S = 4.25e12  # measured copy bandwidth, read + write (PERF.md)
BLOCK_SIZE = 16  # the engine's default


def linear_params(shape: dict[str, Any]) -> int:
    """Parameters of every layer's projections (q, k, v, o, gate, up, down); embeddings and norms excluded."""
    h, hd, ffn = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ffn
    return int(shape["num_hidden_layers"] * per_layer)


def prefill_flops_per_token(shape: dict[str, Any], prompt_len: int) -> float:
    attention = 4 * shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"] * prompt_len / 2
    return 2 * linear_params(shape) + attention


def decode_bytes_per_token(shape: dict[str, Any], context: float) -> float:
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    embeddings = vocab * h * (1 if shape["tie_word_embeddings"] else 2)
    weights = 2 * (linear_params(shape) + embeddings)
    kv_per_token = shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2 * 2
    return weights + context * kv_per_token


def run_budget(args: argparse.Namespace, model_dir: Path, budget: int, rng: random.Random) -> list[dict[str, Any]]:
    shape = SHAPES[args.shape]
    max_model_len = max(args.lengths) + args.output_tokens
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    llm = LLM(
        str(model_dir),
        device=args.device,
        load_format="dummy",
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        # Explicit, not sized from free memory: the engine of the other budget may still hold memory in this
        # process, and one request runs at a time (two sequences' worth leaves room beside the last one's
        # cached blocks).
        num_kv_blocks=2 * blocks_per_seq,
        block_size=BLOCK_SIZE,
        attention_backend=args.attention_backend,
    )
    vocab_ids = 10000  # like W1: ordinary ids, no special tokens

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab_ids) for _ in range(n)]

    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_tokens)
    llm.generate([fresh(n) for n in args.lengths], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    rows = []
    for n in args.lengths:
        ttft, decode_ms, steps, cached = [], [], [], []
        for _ in range(args.repeats):
            steps0 = llm.stats()["num_steps"]
            out = llm.generate([fresh(n)], params, use_tqdm=False)[0]
            m = out.metrics
            assert m is not None and m.time_to_first_token is not None and m.e2e_latency is not None
            cached.append(m.num_cached_tokens)  # 0 expected: every prompt is fresh
            ttft.append(m.time_to_first_token)
            if len(out.token_ids) > 1:
                decode_ms.append(1e3 * (m.e2e_latency - m.time_to_first_token) / (len(out.token_ids) - 1))
            steps.append(int(llm.stats()["num_steps"] - steps0))
        best = min(ttft)
        flops = prefill_flops_per_token(shape, n)
        limit = H200_BF16_FLOPS / flops
        tps = n / best
        decode = statistics.median(decode_ms) if decode_ms else None
        decode_limit_ms = 1e3 * decode_bytes_per_token(shape, n + args.output_tokens / 2) / H200_COPY_BYTES_PER_S
        on_gpu = args.device == "cuda"
        rows.append(
            {
                "workload": "W4",
                "shape": args.shape,
                "device": args.device,
                "max_num_batched_tokens": budget,
                "prefill_chunks": -(-n // budget),
                "prompt_tokens": n,
                "output_tokens": args.output_tokens,
                "ttft_ms": [round(1e3 * t, 2) for t in ttft],
                "prefill_tok_per_s": round(tps),
                "prefill_flops_per_token_g": round(flops / 1e9, 3),
                "prefill_limit_tok_per_s": round(limit),
                "prefill_pct_of_limit": round(100 * tps / limit, 1) if on_gpu else None,
                "prefill_tflops": round(tps * flops / 1e12, 1),
                "decode_ms_per_token": round(decode, 3) if decode is not None else None,
                "decode_limit_ms_per_token": round(decode_limit_ms, 3),
                "decode_pct_of_limit": round(100 * decode_limit_ms / decode, 1) if on_gpu and decode else None,
                "engine_steps_per_request": steps,
                "prefix_cached_tokens": cached,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    if args.profile and budget == max(args.lengths):
        print(json.dumps(profile_prefill(llm, args, max(args.lengths), fresh)), flush=True)
    llm.shutdown()
    return rows


def profile_prefill(llm: LLM, args: argparse.Namespace, n: int, fresh: Any) -> dict[str, Any]:
    """One prefill of `n` fresh tokens under the profiler: GPU time by kernel family and the rate each
    family reaches (GEMM FLOPs: 2 x linear parameters x n; attention FLOPs: the causal QK^T and PV), so the
    prefill kernel's share and efficiency are known before choosing GQA packing or TMA loads for it."""
    head = {"workload": "W4-profile", "shape": args.shape, "device": args.device, "prompt_tokens": n}
    if args.device != "cuda":
        return head | {"skipped": "the GPU timeline needs CUDA"}
    from gpu_timeline import summarize
    from torch.profiler import ProfilerActivity, profile
    from w1_profile import device_intervals

    shape = SHAPES[args.shape]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ttft = llm.generate([fresh(n)], params, use_tqdm=False)[0].metrics.time_to_first_token  # type: ignore[union-attr]
    timeline = summarize(device_intervals(prof.events()))
    out = head | {"ttft_ms": round(1e3 * ttft, 2), "gpu_busy_ms": round(timeline.busy_us / 1e3, 2)}
    return out | prefill_rates(timeline.categories, shape, n)


def prefill_rates(categories: dict[str, tuple[float, int]], shape: dict[str, Any], n: int) -> dict[str, Any]:
    """GEMM and attention time (us, count per category) of one n-token prefill as ms and the TFLOP/s and
    percent of peak each reaches; every other category as ms."""
    gemm_flops = 2 * linear_params(shape) * n
    attention_flops = prefill_flops_per_token(shape, n) * n - gemm_flops
    out: dict[str, Any] = {}
    for name, flops in (("gemm", gemm_flops), ("prefill_attention", attention_flops)):
        us, count = categories.get(name, (0.0, 0))
        rate = flops / (us * 1e-6) if us else 0.0
        out[name] = {
            "ms": round(us / 1e3, 2),
            "kernels": count,
            "tflops": round(rate / 1e12, 1),
            "pct_of_peak": round(100 * rate / H200_BF16_FLOPS, 1),
        }
    rest = categories.items()
    return out | {"other_ms": {c: round(us / 1e3, 2) for c, (us, _) in rest if c not in ("gemm", "prefill_attention")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--budgets", type=int, nargs="+", default=None, help="max_num_batched_tokens values (default: 8192, longest)"
    )
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="also profile one prefill of the longest prompt")
    args = ap.parse_args()
    budgets = args.budgets or [8192, max(args.lengths)]
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    rng = random.Random(0)
    results = {budget: run_budget(args, model_dir, budget, rng) for budget in budgets}
    chunking = {}
    for n in args.lengths:
        best = {b: min(next(r for r in results[b] if r["prompt_tokens"] == n)["ttft_ms"]) for b in budgets}
        chunking[str(n)] = {
            "ttft_best_ms": {str(b): best[b] for b in budgets},
            f"ttft_over_budget_{budgets[0]}": {str(b): round(best[b] / best[budgets[0]], 3) for b in budgets},
        }
    print(json.dumps({"workload": "W4", "shape": args.shape, "device": args.device, "chunking": chunking}))


if __name__ == "__main__":
    main()
