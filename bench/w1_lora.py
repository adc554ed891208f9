"""W1 with LoRA adapters (issue 27): nano-vllm's W1 requests (256, prompts U[100, 1024] of ids < 10000, outputs
U[100, 1024], temperature 0.6, ignore_eos) with 8 rank-16 adapters on every attention and MLP projection,
request i through adapter i % 8, all mixed in every batch, against the same requests on the base model.
Target: >= 0.85x the base model's output tok/s. Random weights of the real shape; the adapters are written
here in PEFT's format (random A and B: no peft needed).

Three runs, each in a process of its own (the device's memory whole for each): "base" (an engine without
LoRA), "lora" (enable_lora, max_loras=8, the 8 adapters mixed) and "lora_base" (the LoRA engine, requests
without adapters: what enabling LoRA costs requests that do not use it). Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from engine_args import run_child
from shapes import SHAPES, W1_LIMIT
from w1_throughput import add_w1_arguments, cap_outputs, w1_engine, w1_requests

from asyncllm import LLM, SamplingParams

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(shape: str, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for every projection of `shape`."""
    import torch
    from safetensors.torch import save_file

    cfg = SHAPES[shape]
    hidden, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    dims = {  # module -> (in, out)
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in dims.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) * n_in**-0.5).to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def measure(args: argparse.Namespace, kind: str) -> dict[str, object]:
    """The fastest of `args.rounds` timed runs on one engine of `kind` (see the module)."""
    prompts, params = w1_requests(args.num_seqs)
    params = cap_outputs(params, args.max_tokens)
    loras: list[str | None] | None = None
    if kind == "base":
        llm = w1_engine(args)
    else:
        llm = w1_engine(args, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
        root = Path(tempfile.mkdtemp())
        names: list[str | None] = [f"lora{i}" for i in range(args.num_adapters)]
        for i, name in enumerate(names):
            llm.add_lora(str(name), write_adapter(args.shape, root / str(name), args.rank, seed=i))
        if kind == "lora":
            loras = [names[i % len(names)] for i in range(len(prompts))]
            warm = SamplingParams(max_tokens=8)  # every adapter into its slot, the kernels compiled
            llm.generate([[1, 2, 3]] * len(names), warm, use_tqdm=False, lora=names)
    try:
        runs = [timed(llm, prompts, params, loras) for _ in range(args.rounds)]
        stats = llm.stats()
    finally:
        llm.shutdown()
    seconds, tokens = min(runs)
    return {
        f"{kind}_tok_s": round(tokens / seconds, 1),
        f"{kind}_seconds": round(seconds, 2),
        f"{kind}_preemptions": stats["num_preemptions"],
        "output_tokens": tokens,
    }


def timed(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], loras: list[str | None] | None
) -> tuple[float, int]:
    """(wall seconds, output tokens) of one `generate` of every request."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_w1_arguments(ap)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="timed runs per engine; the fastest counts")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every output's length (smoke runs)")
    ap.add_argument("--child", choices=["base", "lora", "lora_base"], default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.child is not None:
        print(json.dumps(measure(args, args.child)))
        return
    result: dict[str, object] = {"workload": "W1-LoRA", "shape": args.shape, "requests": args.num_seqs}
    result |= {"adapters": args.num_adapters, "rank": args.rank}
    for kind in ("base", "lora", "lora_base"):
        result |= run_child(__file__, kind)
    rates = {kind: float(str(result[f"{kind}_tok_s"])) for kind in ("base", "lora", "lora_base")}
    result["lora_vs_base"] = round(rates["lora"] / rates["base"], 3)
    result["lora_engine_base_requests_vs_base"] = round(rates["lora_base"] / rates["base"], 3)
    result["target_lora_vs_base"] = 0.85
    limit = W1_LIMIT.get(args.shape)
    result["lora_percent_of_limit"] = round(100 * rates["lora"] / limit, 1) if limit else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
