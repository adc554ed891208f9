"""Quantized weights, end to end: W5 (batch-1 decode: 128-token prompt, ms per output token over 512 tokens,
best of 3, as ../shared/peers/w1_w5.py measures it) and W1 (bench/w1_throughput.py's 256 requests) for the
Qwen3-0.6B and Qwen3-8B shapes, bf16 beside FP8 and int4 (AWQ), each engine in a child process of its own.

Every W5 row carries its limit: the bytes a decode step must read (the linear layers in their quantized
layout, codes, scales and zero points; the bf16 LM head, one embedding row, the KV cache of the average
context) over the copy bandwidth (../shared/PERF.md: 4.25 TB/s), and the percent of it reached. A summary
line checks the issue's targets: W5 Qwen3-0.6B FP8 <= 0.6 ms, int4 <= 0.5 ms; Qwen3-8B FP8 <= 2.2 ms, int4
<= 1.4 ms; W1 Qwen3-8B FP8 >= 1.3x bf16. With .peers carried (bench/gpu_check.sh's set-up), nano-vllm's bf16
W5 of the same shapes runs in the same call (--peers).

The random-weight quantized checkpoints: config.json of the shape (bench/shapes.py) plus the hub's
quantization_config (AWQ: 4 bits, group 128, zero points, GEMM layout; FP8: compressed-tensors per-channel
weights with dynamic per-token activations, as RedHatAI's FP8-dynamic models), and weights either drawn at
load in the quantized layout (load_format="dummy", the default) or written to disk in the hub's layout
(--weights disk; the loader converts them as it would a downloaded checkpoint).

Device machine: python3 bench/quant_bench.py [--shapes qwen3-0.6b qwen3-8b] [--quant bf16 fp8 awq]
    [--workloads w5 w1] [--weights dummy|disk] [--peers] [--device cuda] [--decode-gemv auto off]
(--decode-gemv with several modes runs each engine under each: the one-row GEMV's A/B in one call; each row
carries the mode, how many layers took the GEMV and the start-up's GEMM tuning seconds)
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

HERE = Path(__file__).resolve().parent
COPY_TB_S = 4.25
TARGET_W5_MS = {
    ("qwen3-0.6b", "fp8"): 0.6,
    ("qwen3-0.6b", "awq"): 0.5,
    ("qwen3-8b", "fp8"): 2.2,
    ("qwen3-8b", "awq"): 1.4,
}
GROUP = 128
AWQ = dict(quant_method="awq", bits=4, group_size=GROUP, zero_point=True, version="gemm")
FP8 = dict(
    quant_method="compressed-tensors",
    format="float-quantized",
    ignore=["lm_head"],
    config_groups={
        "group_0": dict(
            targets=["Linear"],
            weights=dict(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="channel"),
            input_activations=dict(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token"),
        )
    },
)


def linear_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Checkpoint module (within a layer) -> (N, K)."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {
        "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i),
    }  # fmt: skip


def step_bytes(cfg: dict[str, Any], quant: str, context: int) -> int:
    """Bytes one batch-1 decode step reads: linear layers in their layout, LM head, KV of `context` tokens."""
    per_weight = {"bf16": 2.0, "fp8": 1.0, "awq": 0.5 + 3 / GROUP}[quant]  # int4: codes, bf16 scale + uint8 zero
    linears = sum(n * k for n, k in linear_shapes(cfg).values()) * cfg["num_hidden_layers"]
    scales = 4 * sum(n for n, _ in linear_shapes(cfg).values()) * cfg["num_hidden_layers"] if quant == "fp8" else 0
    head = cfg["vocab_size"] * cfg["hidden_size"] * 2
    kv = context * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    return int(linears * per_weight + scales + head + kv)


def write_checkpoint(shape: str, quant: str, weights: str, out: Path, device: str) -> Path:
    """The shape's config.json (with the quant's quantization_config) and tokenizer; with weights="disk", random
    safetensors in the hub's layout too."""
    sys.path.insert(0, str(HERE))
    from shapes import SHAPES, write_shape_dir

    write_shape_dir(shape, out)
    cfg = dict(SHAPES[shape])
    if quant != "bf16":
        cfg["quantization_config"] = AWQ if quant == "awq" else FP8
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if weights == "disk":
        _write_weights(cfg, quant, out, device)
    return out


def _write_weights(cfg: dict[str, Any], quant: str, out: Path, device: str) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, device=device, dtype=torch.int32)

    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shard: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(v, h), "model.norm.weight": randn(h) + 1}
    if not cfg["tie_word_embeddings"]:
        shard["lm_head.weight"] = randn(v, h)
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shard[f"{prefix}.{norm}.weight"] = randn(h) + 1
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            shard[f"{prefix}.{norm}.weight"] = randn(cfg["head_dim"]) + 1
        for module, (n, k) in linear_shapes(cfg).items():
            name = f"{prefix}.{module}"
            if quant == "bf16":
                shard[f"{name}.weight"] = randn(n, k)
            elif quant == "awq":  # [K, N/8], [K/G, N/8], [K/G, N]
                shard[f"{name}.qweight"] = words(k, n // 8)
                shard[f"{name}.qzeros"] = words(k // GROUP, n // 8)
                shard[f"{name}.scales"] = (randn(k // GROUP, n).abs() * 0.05).half()
            else:
                shard[f"{name}.weight"] = (torch.randn(n, k, generator=gen, device=device) * 64).to(torch.float8_e4m3fn)
                shard[f"{name}.weight_scale"] = torch.full((n, 1), 0.02 / 64, device=device, dtype=torch.bfloat16)
        if sum(t.numel() * t.element_size() for t in shard.values()) > 2 << 30 or layer == cfg["num_hidden_layers"] - 1:
            save_file({k: t.cpu() for k, t in shard.items()}, str(out / f"model-{layer:05d}.safetensors"))
            shard = {}


def run_child(args: argparse.Namespace) -> None:
    """One engine (args.shape, args.quant): W5 then W1; JSON lines."""
    sys.path.insert(0, str(HERE))
    from shapes import SHAPES, W1_LIMIT
    from w1_throughput import run_w1, w1_requests

    from asyncllm import LLM, SamplingParams

    out = write_checkpoint(args.shape, args.quant, args.weights, Path(tempfile.mkdtemp()) / args.shape, args.device)
    start = time.perf_counter()
    load_format = "dummy" if args.weights == "dummy" else "auto"
    os.environ["ASYNCLLM_DECODE_GEMV"] = args.decode_gemv  # this child's mode (a tuning variable: docs/tuning.md)
    llm = LLM(str(out), device=args.device, load_format=load_format, max_model_len=4096)
    base = {"shape": args.shape, "quant": args.quant, "weights": args.weights, "decode_gemv": args.decode_gemv}
    base["startup_s"] = round(time.perf_counter() - start, 1)
    base["tune_gemm_s"] = round(dict(llm.runtime.startup_seconds).get("tune_gemm", 0.0), 3)
    base["gemv_layers"] = llm.runtime.gemv_layers
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
    if "w5" in args.workloads:
        prompt = [[Random(1).randint(0, 10000) for _ in range(128)]]
        best = {}
        for n in (1, args.w5_tokens + 1):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                llm.generate(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n), use_tqdm=False)
                times.append(time.perf_counter() - t)
            best[n] = min(times)
        ms = (best[args.w5_tokens + 1] - best[1]) / args.w5_tokens * 1000
        nbytes = step_bytes(SHAPES[args.shape], args.quant, context=128 + args.w5_tokens // 2)
        limit_ms = nbytes / (COPY_TB_S * 1e12) * 1e3
        row = {"workload": "W5", **base, "ms_per_token": round(ms, 3), "limit_ms": round(limit_ms, 3)}
        row.update(step_gb=round(nbytes / 1e9, 3), percent_of_limit=round(100 * limit_ms / ms, 1))
        print(json.dumps(row), flush=True)
    if "w1" in args.workloads:
        run = run_w1(llm, *w1_requests(256))
        tps = run.output_tokens / run.seconds
        limit = W1_LIMIT.get(args.shape)
        row = {"workload": "W1", **base, "output_tok_per_s": round(tps, 1), "seconds": round(run.seconds, 2)}
        row["percent_of_bf16_limit"] = round(100 * tps / limit, 1) if limit else None
        print(json.dumps(row), flush=True)
    llm.shutdown()


def run_peers(shape: str) -> dict[str, Any] | None:
    """nano-vllm's bf16 W5 on a random checkpoint of the shape, through ../shared/peers (carried as .peers)."""
    peers = HERE.parent / ".peers"
    if not (peers / "w1_w5.py").is_file():
        return None
    ckpt = Path(tempfile.gettempdir()) / f"peers-{shape}"
    size = shape.removeprefix("qwen3-")
    if not ckpt.is_dir():
        subprocess.run([sys.executable, str(peers / "make_model.py"), size, str(ckpt), str(peers / "qwen3-tokenizer")],
                       check=True, capture_output=True)  # fmt: skip
    proc = subprocess.run([sys.executable, str(peers / "w1_w5.py"), "nanovllm", str(ckpt), "w5"], text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(peers)})  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return {"workload": "W5", "shape": shape, "engine": "nano-vllm", **json.loads(line[len("RESULT") :])}
    return {"workload": "W5", "shape": shape, "engine": "nano-vllm", "error": proc.stderr[-500:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    ap.add_argument("--quant", nargs="+", default=["bf16", "fp8", "awq"], choices=["bf16", "fp8", "awq"])
    ap.add_argument("--workloads", nargs="+", default=["w5", "w1"], choices=["w5", "w1"])
    ap.add_argument("--weights", default="dummy", choices=["dummy", "disk"])
    ap.add_argument("--w5-tokens", type=int, default=512, help="decode tokens timed for W5")
    ap.add_argument("--peers", action="store_true", help="nano-vllm's bf16 W5 beside (needs .peers)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (--shapes qwen3-tiny)")
    gemv_help = "the engines' ASYNCLLM_DECODE_GEMV; several: each (shape, quant) under each, an A/B in one call"
    ap.add_argument("--decode-gemv", nargs="+", default=["auto"], choices=["auto", "on", "off"], help=gemv_help)
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "QUANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.shape, args.quant = args.child
        args.decode_gemv = args.decode_gemv[0]
        run_child(args)
        return
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for shape in args.shapes:
        for quant in args.quant:
            workloads = [w for w in args.workloads if w == "w5" or (shape == "qwen3-8b" and quant in ("bf16", "fp8"))]
            for mode in args.decode_gemv if workloads else ():
                cmd = [sys.executable, __file__, "--child", shape, quant, "--weights", args.weights]
                cmd += ["--device", args.device, "--w5-tokens", str(args.w5_tokens), "--workloads", *workloads]
                proc = subprocess.run([*cmd, "--decode-gemv", mode], stdout=subprocess.PIPE, text=True, check=False)
                for line in proc.stdout.splitlines():
                    if line.startswith("{"):
                        row = json.loads(line)
                        if mode == args.decode_gemv[0]:  # the summary reads the first mode's rows
                            rows[(shape, quant, row["workload"])] = row
                        print(line, flush=True)
                if proc.returncode:
                    error = {"shape": shape, "quant": quant, "decode_gemv": mode, "error": f"exit {proc.returncode}"}
                    print(json.dumps(error), flush=True)
        if args.peers and (peer := run_peers(shape)) is not None:
            print(json.dumps(peer), flush=True)
    summary: dict[str, Any] = {"summary": "quant_bench"}
    for (shape, quant), target in TARGET_W5_MS.items():
        if (row := rows.get((shape, quant, "W5"))) is not None:
            summary[f"w5_{shape}_{quant}_ms"] = row["ms_per_token"]
            summary[f"w5_{shape}_{quant}_met"] = row["ms_per_token"] <= target
    bf16, fp8 = rows.get(("qwen3-8b", "bf16", "W1")), rows.get(("qwen3-8b", "fp8", "W1"))
    if bf16 and fp8:
        ratio = fp8["output_tok_per_s"] / bf16["output_tok_per_s"]
        summary.update(w1_8b_fp8_over_bf16=round(ratio, 3), w1_target=">= 1.3", w1_met=ratio >= 1.3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
