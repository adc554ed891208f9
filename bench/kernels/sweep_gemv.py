"""The GEMV's launch configs, swept per layer shape at one token row: which `GemvConfig` (kernels/gemv_plan.py:
tile rows, warps, bytes of each weight row per K tile, programs per SM; for int4 the exact or the folded
unpacking of codes, three instructions a code instead of four) streams each weight fastest, for
Qwen3-0.6B's and Qwen3-8B's layers in AWQ int4 (group 128, zero points), e4m3 per channel and bf16, beside
cuBLAS bf16 (both weight layouts: the start-up tuner picks one) and the split-K Triton GEMM (quant_matmul).

GPU time per call from replays of a CUDA graph (graph replay is how decode runs), several weight copies
rotated so none is read from L2; TB/s counts the bytes the path must read (codes, scales and zero points, or
the bf16 weight), against the copy bandwidth (`COPY_TB_S`, ../shared/PERF.md). Every config's output is first
checked against the reference (quant_matmul_ref, or F.linear in float32) at bf16 tolerance; a config that
fails to compile or to match is listed under "failed" and never picked.

Prints one JSON line per (shape, layer, kind): the best config, its microseconds, TB/s and percent of the
copy bandwidth, the default config's, cuBLAS's and the GEMM's; then `TUNED_CONFIGS`, a Python literal for
kernels/gemv_plan.py holding the shapes whose best config beat the default by more than --min-gain.

Device machine: python3 bench/kernels/sweep_gemv.py [--shapes qwen3-0.6b qwen3-8b] [--kinds int4 fp8 bf16]
    [--min-gain 0.03]   (~1-2 min: most of it compiling the candidate tiles)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncllm.kernels import gemv_plan as plans
from asyncllm.kernels import quant_matmul as qm
from asyncllm.kernels import quant_matmul_gemv as gemv
from asyncllm.kernels.quant_matmul_ref import pack_codes, quant_matmul_ref, quantize_fp8_rows
from asyncllm.worker.gemm_layout import graph_time_us

SHAPES = {  # layer: (N, K)
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
}
COPY_TB_S = 4.25
GROUP = 128
KINDS = {"int4": 4, "fp8": plans.E4M3, "bf16": plans.FLOAT16}  # name -> gemv_plan kind


def _weight(kind: str, n: int, k: int) -> dict[str, torch.Tensor]:
    if kind == "int4":
        return dict(
            qweight=pack_codes(torch.randint(0, 16, (n, k), device="cuda"), 4),
            scales=(torch.rand(n, k // GROUP, device="cuda") * 0.01).half(),
            qzeros=torch.randint(0, 16, (n, k // GROUP), device="cuda", dtype=torch.uint8),
        )
    if kind == "fp8":
        qweight, scales = quantize_fp8_rows(torch.randn(n, k, device="cuda") * 0.02)
        return dict(qweight=qweight, scales=scales)
    return dict(weight=(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16))


def _gemv_call(kind: str, w: dict[str, torch.Tensor], x: torch.Tensor, locks: torch.Tensor,
               config: plans.GemvConfig) -> Callable[[], torch.Tensor]:  # fmt: skip
    if kind == "bf16":
        return lambda: gemv.linear_gemv(x, w["weight"], locks=locks, config=config)
    bits, group = (4, GROUP) if kind == "int4" else (8, x.shape[1])
    return lambda: gemv.quant_gemv(x, w["qweight"], w["scales"], w.get("qzeros"), bits=bits, group_size=group,
                                   locks=locks, config=config)  # fmt: skip


def _reference(kind: str, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if kind == "bf16":
        return F.linear(x.float(), w["weight"].float())
    bits, group = (4, GROUP) if kind == "int4" else (8, x.shape[1])
    return quant_matmul_ref(x.float(), w["qweight"], w["scales"], w.get("qzeros"), bits=bits, group_size=group)


def configs_for(kind: int) -> list[plans.GemvConfig]:
    """The default config first, then every candidate for weights of `kind`."""
    return [plans.DEFAULT_CONFIG, *plans.candidate_configs(kind)]


def _copies(nbytes: int) -> int:
    """Weight copies read in turn: at least 200 MB (more than L2 holds), 2 to 8 of them."""
    return max(2, min(8, -(-(200 << 20) // nbytes)))


def _name(config: plans.GemvConfig) -> str:
    c = config
    fold = "-fold" if c.fold_offsets else ""
    return f"bn{c.block_n}-w{c.num_warps}-rb{c.row_bytes}-p{c.programs_per_sm}-s{c.max_split}{fold}"


def sweep(shape: str, layer: str, kind: str, n: int, k: int) -> tuple[dict[str, object], plans.GemvConfig | None]:
    """The shape's JSON row and its best config (None: every config failed)."""
    one = _weight(kind, n, k)
    nbytes = sum(t.numel() * t.element_size() for t in one.values())
    weights = [one] + [_weight(kind, n, k) for _ in range(_copies(nbytes) - 1)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    locks = plans.gemv_locks(n, 1, torch.device("cuda"))
    want = _reference(kind, weights[0], x)
    row: dict[str, object] = {
        "shape": shape,
        "layer": layer,
        "kind": kind,
        "n": n,
        "k": k,
        "mb": round(nbytes / 1e6, 2),
    }
    configs = configs_for(KINDS[kind])
    times: dict[plans.GemvConfig, float] = {}
    failed: dict[str, str] = {}
    for config in configs:
        try:
            got = _gemv_call(kind, weights[0], x, locks, config)().float()
            if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                failed[_name(config)] = f"max error {float((got - want).abs().max()):.3g}"
                continue
            times[config] = graph_time_us([_gemv_call(kind, w, x, locks, config) for w in weights])
        except Exception as exc:  # report every config, pick among the rest
            failed[_name(config)] = f"{type(exc).__name__}: {str(exc)[:200]}"
    tb_s = lambda us: round(nbytes / (us * 1e-6) / 1e12, 3)  # noqa: E731
    ranked = sorted(times, key=times.__getitem__)
    if ranked:
        best = ranked[0]
        row.update(
            best=_name(best), best_config=best.__dict__, best_us=round(times[best], 2), best_tb_s=tb_s(times[best])
        )
        row["best_pct"] = round(100 * tb_s(times[best]) / COPY_TB_S, 1)
        row["top3"] = [(_name(c), round(times[c], 2)) for c in ranked[:3]]
    if plans.DEFAULT_CONFIG in times:
        us = times[plans.DEFAULT_CONFIG]
        row.update(default_us=round(us, 2), default_tb_s=tb_s(us), gain_vs_default=round(us / times[ranked[0]] - 1, 3))
    dense = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(_copies(2 * n * k))]
    row["cublas_bf16_us"] = round(graph_time_us([lambda w=w: F.linear(x, w) for w in dense]), 2)
    dense = [w.t().contiguous().t() for w in dense]  # the [in, out] layout the start-up tuner may pick
    row["cublas_bf16_t_us"] = round(graph_time_us([lambda w=w: F.linear(x, w) for w in dense]), 2)
    if kind != "bf16":
        bits, group = (4, GROUP) if kind == "int4" else (8, k)
        row["splitk_gemm_us"] = round(graph_time_us([
            lambda w=w: qm.quant_matmul(x, w["qweight"], w["scales"], w.get("qzeros"), bits=bits, group_size=group)
            for w in weights
        ]), 2)  # fmt: skip
    if failed:
        row["failed"] = failed
    return row, ranked[0] if ranked else None


def format_table(tuned: list[tuple[tuple[str, int, int], plans.GemvConfig, str]]) -> str:
    """`TUNED_CONFIGS` as Python source for kernels/gemv_plan.py: one line per (key, config, comment)."""
    lines = ["TUNED_CONFIGS: dict[tuple[str, int, int], GemvConfig] = {"]
    for key, config, comment in tuned:
        fields = ", ".join(f"{name}={value}" for name, value in config.__dict__.items())
        lines.append(f"    {key!r}: GemvConfig({fields}),  # {comment}")
    return "\n".join([*lines, "}"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument(
        "--min-gain", type=float, default=0.03, help="tune a shape only where its best beats the default by this"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA"}))
        return
    torch.manual_seed(0)
    start = time.perf_counter()
    tuned: list[tuple[tuple[str, int, int], plans.GemvConfig, str]] = []
    for shape in args.shapes:
        for layer, (n, k) in SHAPES[shape].items():
            for kind in args.kinds:
                row, best = sweep(shape, layer, kind, n, k)
                print(json.dumps(row), flush=True)
                gain = row.get("gain_vs_default")
                if best is not None and isinstance(gain, float) and gain > args.min_gain:
                    comment = f"{shape} {layer}: {row['default_us']} -> {row['best_us']} us, {row['best_tb_s']} TB/s"
                    tuned.append(((plans.kind_name(KINDS[kind]), n, k), best, comment))
                torch.cuda.empty_cache()
    summary = {"summary": "sweep_gemv", "seconds": round(time.perf_counter() - start, 1), "tuned_shapes": len(tuned)}
    print(json.dumps(summary), flush=True)
    print(format_table(tuned), flush=True)


if __name__ == "__main__":
    main()
