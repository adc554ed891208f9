"""Micro-benchmark of the fused Triton kernels (kernels/rms_norm.py, silu_mul.py, qk_norm_rope_kv.py) against
their torch references, eager and torch.compile'd (mode default), at Qwen3-0.6B and Qwen3-8B shapes, bfloat16,
T = 1, 8, 64, 256, 2048 tokens. The kernel is checked against the eager reference on the GPU first.

One JSON line per (kernel, model, T): GPU time of each variant in microseconds (median over samples of a batch
of back-to-back calls queued behind a GPU sleep, so host launch overhead is hidden: CUDA-graph conditions),
the bytes the fused op must move (read + written), the Triton kernel's bandwidth as a share of the H200's copy
bandwidth (`COPY_TB_S`, from ../shared/PERF.md), and the winner. Inputs that fit in L2 are flagged: their
bandwidth can exceed HBM's. The qk reference filters padding slots with a boolean index (a host sync).
Run on the device machine from the repo root: python3 bench/kernels/bench_fused.py
(one to two minutes, mostly torch.compile; --no-compile, --kernels, --models, --tokens for quicker runs)
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

COPY_TB_S = 4.25  # measured H200 copy bandwidth (read + write), ../shared/PERF.md
MODELS = {
    "qwen3-0.6b": dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072),
    "qwen3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=12288),
}
TOKENS = [1, 8, 64, 256, 2048]
EPS, BLOCK, MAX_POSITIONS = 1e-6, 16, 4096
DTYPE = torch.bfloat16
DEVICE = "cuda"  # tests/kernels/test_bench_fused.py runs the cases on CPU shapes through the interpreter
TOLERANCE = 2e-2  # bfloat16 row of tests/fixtures/triton_kernels.py TOLERANCE


def time_us(fn: Callable[[], object], inner: int = 20, samples: int = 15) -> tuple[float, float]:
    """(GPU time, host time) per call in microseconds. GPU: the median over samples, each `inner` calls queued
    behind a GPU sleep that outlasts the host's launching, so the events see back-to-back execution, not
    launch overhead. Host: the time to issue a call (eager mode pays the larger of the two)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    host_s = time.perf_counter() - t0  # host time to issue `inner` calls
    torch.cuda.synchronize()
    cycles = int(1.5 * host_s * 1e3 * _cycles_per_ms()) + 10_000
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times), host_s * 1e6 / inner


def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)


_CYCLES_PER_MS: list[float] = []


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep, measured once."""
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(10_000_000 / start.elapsed_time(end))
    return _CYCLES_PER_MS[0]


def compare(got: torch.Tensor, ref: torch.Tensor, per_head: bool = False) -> dict:
    """Max error (relative to each head's scale for rotated outputs), share of bit-identical elements, verdict."""
    err = (got.float() - ref.float()).abs()
    scale = ref.float().abs().amax(-1, keepdim=True) if per_head else ref.float().abs()
    err = err / (1 + scale)  # err <= TOLERANCE * (1 + |ref|): atol = rtol = TOLERANCE, as the tests
    ok = bool((err <= TOLERANCE).all()) and not got.isnan().any()
    exact = (got == ref).float().mean().item()
    return dict(check="ok" if ok else "FAIL", max_scaled_err=round(err.max().item(), 5), bit_exact_frac=round(exact, 5))


# ------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    kernel: Callable[[], object]  # the Triton kernel on this case's buffers
    ref_args: tuple  # the reference's positional arguments
    ref_kwargs: dict
    bytes_moved: int  # what the fused op must read and write, at least
    check: dict  # the kernel against the eager reference


def rms_norm_case(mod, shape: dict, tokens: int) -> Case:
    hidden = shape["hidden"]
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    residual = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    weight = (1 + 0.5 * torch.randn(hidden, device=DEVICE)).to(DTYPE)
    out = torch.empty_like(x)
    res_k, res_r = residual.clone(), residual.clone()
    got = mod.rms_norm(x, weight, EPS, residual=res_k, out=out)
    check = compare(got, mod.rms_norm_ref(x, weight, EPS, res_r))
    if not torch.equal(res_k, res_r):
        check["check"] = "FAIL (residual)"
    moved = (4 * tokens * hidden + hidden) * x.element_size()  # x, residual, weight in; residual, out back
    kernel = lambda: mod.rms_norm(x, weight, EPS, residual=residual, out=out)  # noqa: E731
    return Case(kernel, (x, weight, EPS, residual), {}, moved, check)


def silu_mul_case(mod, shape: dict, tokens: int) -> Case:
    inter = shape["inter"]
    x = 3 * torch.randn(tokens, 2 * inter, device=DEVICE, dtype=DTYPE)
    out = torch.empty(tokens, inter, device=DEVICE, dtype=DTYPE)
    check = compare(mod.silu_and_mul(x, out=out), mod.silu_and_mul_ref(x))
    return Case(lambda: mod.silu_and_mul(x, out=out), (x,), {}, 3 * tokens * inter * x.element_size(), check)


def qk_case(mod, shape: dict, tokens: int) -> Case:
    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE, dtype=DTYPE)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim)
    freqs = torch.arange(MAX_POSITIONS, device=DEVICE).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    num_blocks = tokens // BLOCK + 2
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK, kv_heads, dim, device=DEVICE, dtype=DTYPE) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    args = dict(
        positions=torch.randint(0, MAX_POSITIONS, (tokens,), device=DEVICE),
        cos_cache=freqs.cos(),
        sin_cache=freqs.sin(),
        slot_mapping=torch.randperm(num_blocks * BLOCK, device=DEVICE)[:tokens],  # scattered, no padding
        q_norm_weight=(1 + 0.25 * torch.randn(dim, device=DEVICE)).to(DTYPE),
        k_norm_weight=(1 + 0.25 * torch.randn(dim, device=DEVICE)).to(DTYPE),
        eps=EPS,
    )
    q_out = torch.empty(tokens, heads, dim, device=DEVICE, dtype=DTYPE)
    got = mod.qk_norm_rope_kv(qkv, k_cache=k_cache, v_cache=v_cache, q_out=q_out, **args)
    check = compare(got, mod.qk_norm_rope_kv_ref(qkv, k_cache=k_ref, v_cache=v_ref, **args), per_head=True)
    slots = args["slot_mapping"]
    keys = compare(k_cache.flatten(0, 1)[slots], k_ref.flatten(0, 1)[slots], per_head=True)
    if keys["check"] != "ok" or not torch.equal(v_cache, v_ref):
        check["check"] = "FAIL (cache)"
    e, t = qkv.element_size(), tokens
    moved = (
        t * (heads + 2 * kv_heads) * dim * e  # qkv in
        + 2 * t * 8  # positions, slots (int64)
        + 2 * t * (dim // 2) * 4  # a cos and a sin row per token (float32)
        + 2 * dim * e  # norm weights
        + t * heads * dim * e  # q out
        + 2 * t * kv_heads * dim * e  # k and v into the cache
    )
    kernel = lambda: mod.qk_norm_rope_kv(qkv, k_cache=k_cache, v_cache=v_cache, q_out=q_out, **args)  # noqa: E731
    return Case(kernel, (qkv,), dict(k_cache=k_ref, v_cache=v_ref, **args), moved, check)


KERNELS = {  # name: (module, reference, case builder)
    "rms_norm+residual": ("rms_norm", "rms_norm_ref", rms_norm_case),
    "silu_and_mul": ("silu_mul", "silu_and_mul_ref", silu_mul_case),
    "qk_norm_rope_kv": ("qk_norm_rope_kv", "qk_norm_rope_kv_ref", qk_case),
}


def bench(name: str, model: str, tokens: int, compiled: dict[str, Callable], use_compile: bool) -> bool:
    """Prints one JSON line; returns whether the kernel passed its check."""
    module_name, ref_name, make_case = KERNELS[name]
    mod = importlib.import_module(f"asyncllm.kernels.{module_name}")
    torch.manual_seed(tokens)
    case = make_case(mod, MODELS[model], tokens)
    ref = getattr(mod, ref_name)
    dtype = str(DTYPE).removeprefix("torch.")
    line = dict(kernel=name, model=model, tokens=tokens, dtype=dtype, bytes=case.bytes_moved, **case.check)
    timed = {"eager": time_us(lambda: ref(*case.ref_args, **case.ref_kwargs))}
    if use_compile:
        if name not in compiled:
            compiled[name] = torch.compile(ref)  # one wrapper per reference: it recompiles for new shapes
        fn = compiled[name]
        try:
            timed["compiled"] = time_us(lambda: fn(*case.ref_args, **case.ref_kwargs))
        except Exception as err:  # a compile or run failure is a result to report; the rest still runs
            line["compile_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    timed["triton"] = time_us(case.kernel)
    for variant in ("eager", "compiled", "triton"):
        gpu_us, host_us = timed.get(variant, (None, None))
        line[f"{variant}_us"] = None if gpu_us is None else round(gpu_us, 2)
        line[f"{variant}_host_us"] = None if host_us is None else round(host_us, 2)
    tb_s = case.bytes_moved / line["triton_us"] / 1e6
    line["triton_tb_s"] = round(tb_s, 3)
    line["triton_pct_of_copy_bw"] = round(100 * tb_s / COPY_TB_S, 1)
    line["fits_in_l2"] = case.bytes_moved < l2_bytes()
    line["winner"] = min(timed, key=lambda k: timed[k][0])  # by GPU time
    line["speedup_vs_eager"] = round(line["eager_us"] / line["triton_us"], 2)
    if line["compiled_us"] is not None:
        line["speedup_vs_compiled"] = round(line["compiled_us"] / line["triton_us"], 2)
    print(json.dumps(line), flush=True)
    return case.check["check"] == "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="*", type=int, default=TOKENS)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd references")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "bench_fused needs a CUDA device; the CPU checks are tests/kernels"}))
        return
    dynamo_config = importlib.import_module("torch._dynamo").config
    limits = [n for n in ("recompile_limit", "cache_size_limit") if hasattr(dynamo_config, n)]
    setattr(dynamo_config, limits[0], 64)  # one compiled reference serves every shape: allow recompiles
    compiled: dict = {}
    failed = []
    started = time.perf_counter()
    for name in args.kernels:
        for model in args.models:
            for tokens in args.tokens:
                if not bench(name, model, tokens, compiled, not args.no_compile):
                    failed.append((name, model, tokens))
    print(json.dumps({"done_s": round(time.perf_counter() - started, 1), "failed_checks": failed}))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
