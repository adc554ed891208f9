"""W5 (batch-1 decode: 128 prompt tokens, ms per output token over 512, best of 3) with the one-row GEMV and its
prologues (layers/prologue.py: the norm folded into qkv and gate_up, SiLU-and-mul into down) against cuBLAS, in
one process: an engine per ASYNCLLM_DECODE_GEMV mode, one after the other, each on random weights of the real shape.

Modes: "auto" (start-up timing: each layer shape and each norm/activation pair takes the fused GEMV only where
it timed faster, the saved launch included), "off" (cuBLAS and separate norm/activation launches everywhere),
"on" (every layer the GEMV, every fusable pair folded); "+pdl" adds ASYNCLLM_DECODE_PDL=1 (the chain's Triton kernels
launched as programmatic dependents, the GEMVs asking L2 for their weights before they wait); "+layer" adds
ASYNCLLM_DECODE_LAYER=1 (each eligible decoder layer one persistent launch at one row). Each row: ms per token,
the start-up (the engine's construction, and its tune_gemm phase: the GEMM layouts and the GEMV/prologue
timing), how many linear layers take a GEMV at one row, how many of them fold the op before them, and how many
decoder layers run as one launch. "auto" runs first, so its start-up pays the Triton compiles of the
GEMV variants (the later modes reuse them from this process); compare tune_gemm across modes for the timing's
own cost. A last line gives the ratios to "off".

Usage (CUDA, ~80 s for the 0.6B): python3 bench/w5_fused.py [--shapes qwen3-0.6b qwen3-8b]
[--modes auto off on auto+pdl] [--w5-tokens 512] [--engine-arg NAME=VALUE]; on CPU, a smoke run:
TRITON_INTERPRET=1 ... --shapes qwen3-tiny --device cpu --attention-backend triton --w5-tokens 4 --modes auto off on
--engine-arg dtype=float32.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_args import add_engine_arg_option, engine_kwargs, free_device_memory, tuning_env
from gemma3_w1_w5 import run_w5
from shapes import write_shape_dir

from asyncllm import LLM, SamplingParams

# "+pdl": ASYNCLLM_DECODE_PDL=1 (Hopper or newer); "+layer": ASYNCLLM_DECODE_LAYER=1 (a layer a launch at one row)
MODES = ("auto", "off", "on", "auto+pdl", "on+pdl", "on+layer", "on+pdl+layer")


def measure(args: argparse.Namespace, model_dir: Path, mode: str) -> dict[str, Any]:
    """One engine under `mode`: its start-up, what the layers chose, W5."""
    kwargs: dict[str, Any] = dict(max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks)
    kwargs |= dict(attention_backend=args.attention_backend) | engine_kwargs(args.engine_arg)
    start = time.perf_counter()
    gemv, *extra = mode.split("+")
    with tuning_env(decode_gemv=gemv, decode_pdl="pdl" in extra, decode_layer="layer" in extra):
        llm = LLM(str(model_dir), device=args.device, load_format="dummy", **kwargs)
    startup = time.perf_counter() - start
    try:
        runtime = llm.runtime
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        w5 = run_w5(llm, args.w5_tokens)
        return {
            "decode_gemv": mode,
            "w5_ms_per_token": w5["ms_per_token"],
            "startup_s": round(startup, 2),
            "tune_gemm_s": round(dict(runtime.startup_seconds).get("tune_gemm", 0.0), 3),
            "gemv_layers": runtime.gemv_layers,
            "prologue_layers": runtime.prologue_layers,
            "decode_layers": runtime.decode_layers,
        }
    finally:
        llm.shutdown()
        del llm
        free_device_memory()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b"], help="qwen3-8b too: add it (~2 min more)")
    ap.add_argument("--modes", nargs="+", default=["auto", "off", "on", "auto+pdl"], choices=MODES)
    ap.add_argument("--w5-tokens", type=int, default=512, help="decode tokens timed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-kv-blocks", type=int, default=1024, help="fixed: engines follow each other in one process")
    add_engine_arg_option(ap)
    return ap


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parser().parse_args(argv)
    rows = []
    for shape in args.shapes:
        model_dir = write_shape_dir(shape, Path(tempfile.mkdtemp()) / shape)
        by_mode = {}
        for mode in args.modes:
            row = {"workload": "W5", "shape": shape, **measure(args, model_dir, mode)}
            by_mode[mode] = row
            rows.append(row)
            print(json.dumps(row), flush=True)
        if "off" in by_mode:
            off = by_mode["off"]
            summary: dict[str, Any] = {"workload": "w5_fused_vs_off", "shape": shape}
            for mode, row in by_mode.items():
                if mode != "off":
                    summary[f"{mode}_ms_ratio"] = round(row["w5_ms_per_token"] / off["w5_ms_per_token"], 3)
                    summary[f"{mode}_startup_s_more"] = round(row["startup_s"] - off["startup_s"], 2)
            rows.append(summary)
            print(json.dumps(summary), flush=True)
    return rows


if __name__ == "__main__":
    main()
