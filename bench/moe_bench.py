"""W1 and W5 (../shared/PERF.md) on the Qwen3-30B-A3B shape: random weights of the real shape
(`load_format="dummy"`, 61 GB in bfloat16), the real tokenizer, one GPU. Prints one JSON line per workload with
its physical limit beside the measurement, counted from bytes and FLOPs as PERF.md does:

- W5 (one request, 128 prompt tokens, ms per output token = (time for 513 tokens - time for 1) / 512, best of
  3): each token reads the active parameters (attention, router, the top 8 experts of every layer, the LM head)
  and the KV cache at `H200_COPY_BYTES_PER_S`.
- W1 (nano-vllm's 256 requests, bench/w1_throughput.py): the prompts' prefill at `H200_BF16_FLOPS` (active
  parameters and attention), then every decode step of the ideal schedule (all requests decoding together,
  each leaving when its output is done) reading the dense weights, the experts its rows touch (with uniform
  routing b rows touch E * (1 - (1 - K/E)^b) of a layer's E experts: all of them at large batches) and the
  KV cache.

Device machine: python3 bench/moe_bench.py [--skip-w1] [--skip-w5] [--engine-arg NAME=VALUE]
CPU smoke run: python3 bench/moe_bench.py --shape qwen3-moe-tiny --device cpu --num-seqs 2 --max-tokens 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from random import Random
from typing import Any

from engine_args import add_engine_arg_option, engine_kwargs
from shapes import SHAPES, write_shape_dir
from w1_throughput import cap_outputs, run_w1, w1_requests

from asyncllm import LLM, SamplingParams

H200_BF16_FLOPS = 790e12  # measured dense bf16 matmul (PERF.md)
H200_COPY_BYTES_PER_S = 4.25e12  # measured copy bandwidth, read + write (PERF.md)
DTYPE_BYTES = 2  # bfloat16


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """Parameter counts of a Qwen3-MoE config, per layer unless named otherwise."""

    layers: int
    dense: int  # attention, router and norms: read whatever the routing
    expert: int  # one expert's gate, up and down projections
    num_experts: int
    top_k: int
    head: int  # the LM head (the embedding reads one row per token: not counted)
    kv_bytes_per_token: int  # every layer's K and V
    attention_flops_per_pair: int  # one query attending one key, every layer: QK^T and PV

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> MoEShape:
        hidden, heads, kv_heads, dim = (
            cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        )
        attention = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 2 * dim  # q/k/v, o, q/k norms
        dense = attention + hidden * cfg["num_experts"] + 2 * hidden  # + router, two norms
        layers = cfg["num_hidden_layers"]
        return cls(
            layers=layers,
            dense=dense,
            expert=3 * hidden * cfg["moe_intermediate_size"],
            num_experts=cfg["num_experts"],
            top_k=cfg["num_experts_per_tok"],
            head=cfg["vocab_size"] * hidden,
            kv_bytes_per_token=layers * 2 * kv_heads * dim * DTYPE_BYTES,
            attention_flops_per_pair=layers * 4 * heads * dim,
        )

    @property
    def active_params(self) -> int:
        """What one token reads at batch 1: the dense part, its top k experts per layer, the LM head."""
        return self.layers * (self.dense + self.top_k * self.expert) + self.head

    def experts_touched(self, rows: int) -> float:
        """The expected number of a layer's experts that `rows` tokens route to (uniform routing)."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** rows)

    def decode_step_bytes(self, rows: int, context_tokens: int) -> float:
        experts = self.layers * self.experts_touched(rows) * self.expert
        weights = (self.layers * self.dense + experts + self.head) * DTYPE_BYTES
        return weights + context_tokens * self.kv_bytes_per_token


def w5_limit_ms(shape: MoEShape, prompt_len: int, new_tokens: int) -> float:
    """ms per output token at batch 1: active parameters plus the KV cache at its mean length."""
    return 1e3 * shape.decode_step_bytes(1, prompt_len + new_tokens // 2) / H200_COPY_BYTES_PER_S


def w1_limit_s(shape: MoEShape, prompt_lens: list[int], output_lens: list[int]) -> dict[str, float]:
    """Seconds for the prefill (compute-bound) and the decode steps (read-bound) of the ideal schedule."""
    prefill_flops = sum(
        2 * (shape.active_params - shape.head) * n + shape.attention_flops_per_pair * n * (n + 1) // 2
        for n in prompt_lens
    )
    prefill_flops += 2 * shape.head * len(prompt_lens)  # the LM head runs on each prompt's last token only
    decode_s = 0.0
    for step in range(1, max(output_lens)):  # the first output token comes from the prefill
        running = [(p, o) for p, o in zip(prompt_lens, output_lens) if o > step]
        context = sum(p + step for p, _ in running)
        decode_s += shape.decode_step_bytes(len(running), context) / H200_COPY_BYTES_PER_S
    return {"prefill_s": prefill_flops / H200_BF16_FLOPS, "decode_s": decode_s}


def measure_w5(llm: LLM, tokens: int) -> dict[str, float]:
    rng = Random(1)
    prompt = [[rng.randint(0, 10000) for _ in range(128)]]
    best = {}
    for n in (1, tokens + 1):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n), use_tqdm=False)
            times.append(time.perf_counter() - start)
        best[n] = min(times)
    return {"ms_per_token": 1e3 * (best[tokens + 1] - best[1]) / tokens, "ttft_ms": 1e3 * best[1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[s for s in SHAPES if "moe" in s or "a3b" in s])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-seqs", type=int, default=256, help="W1's requests")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap W1's output lengths (smoke runs)")
    ap.add_argument("--w5-tokens", type=int, default=512)
    ap.add_argument("--skip-w1", action="store_true")
    ap.add_argument("--skip-w5", action="store_true")
    add_engine_arg_option(ap)
    args = ap.parse_args()
    shape = MoEShape.of(SHAPES[args.shape])
    model_dir = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    extra = engine_kwargs(args.engine_arg)
    start = time.perf_counter()
    llm = LLM(str(model_dir), device=args.device, load_format="dummy", max_model_len=args.max_model_len, **extra)
    base = {
        "shape": args.shape,
        "kv_blocks": llm.runtime.num_kv_blocks,
        "startup_s": round(time.perf_counter() - start, 1),
    }
    base |= {"engine_args": extra} if extra else {}
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
    if not args.skip_w5:
        w5 = measure_w5(llm, args.w5_tokens)
        limit = w5_limit_ms(shape, 128, args.w5_tokens)
        result = {k: round(v, 3) for k, v in w5.items()} | {"limit_ms_per_token": round(limit, 3)}
        result["percent_of_limit"] = round(100 * limit / w5["ms_per_token"], 1)
        print(
            json.dumps({"workload": "W5", **base, **result, "active_bytes": shape.active_params * DTYPE_BYTES}),
            flush=True,
        )
    if not args.skip_w1:
        prompts, params = w1_requests(args.num_seqs)
        params = cap_outputs(params, args.max_tokens)
        run = run_w1(llm, prompts, params)
        limit = w1_limit_s(shape, [len(p) for p in prompts], [p.max_tokens or 0 for p in params])
        limit_s = limit["prefill_s"] + limit["decode_s"]
        tps, limit_tps = run.output_tokens / run.seconds, run.output_tokens / limit_s
        result = {
            "output_tokens": run.output_tokens,
            "seconds": round(run.seconds, 2),
            "output_tok_per_s": round(tps, 1),
        }
        result |= {"limit_tok_per_s": round(limit_tps, 1), "percent_of_limit": round(100 * tps / limit_tps, 1)}
        result |= {k: round(v, 3) for k, v in limit.items()} | {"steps": run.steps}
        print(
            json.dumps({"workload": "W1", **base, **result, "preemptions": llm.stats()["num_preemptions"]}), flush=True
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
