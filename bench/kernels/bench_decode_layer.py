"""The persistent decode layer (kernels/decode_layer.py: a decoder layer in one launch) against the kernels the
engine launches for the same layer today, over a whole model's layers (each with its own weights, as a model
reads them) replayed from one CUDA graph, bf16. The engine's chain at one row: RMSNorm + qkv GEMV, q/k norm +
rotary + KV store, decode attention with its folded reduce, o_proj GEMV, add + RMSNorm + gate/up GEMV,
SiLU-and-mul + down GEMV, each a programmatic dependent launch (PDL) but the attention; then ("prefetch") the
attention a programmatic dependent too and the GEMVs asking L2 for their weights before they wait; at more rows
cuBLAS and the separate norm and activation kernels. The fused layer's output is first checked against decode_layer_ref.

Prints one JSON line per (shape, rows, context): microseconds a layer for each, their ratio, and the limit:
the layer's weight bytes at the card's peak bandwidth (H100 3.35 TB/s, H200 4.8 TB/s).
Device machine: python3 bench/kernels/bench_decode_layer.py [--shapes qwen3-0.6b qwen3-8b] [--rows 1 4 8]
[--context 512 2048] [--variants 4:1:32 8:3:16] [--timing: each phase's and barrier's
time in one launch, from the programs' clocks]   (~1 min)
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F

from asyncllm.attention.triton_backend import load_paged_attention
from asyncllm.kernels import decode_layer as dl
from asyncllm.kernels import quant_matmul_gemv as gemv
from asyncllm.kernels.decode_layer_plan import PREFETCH_MODES
from asyncllm.kernels.paged_attention_plan import choose_num_splits
from asyncllm.kernels.qk_norm_rope_kv import qk_norm_rope_kv
from asyncllm.kernels.rms_norm import rms_norm
from asyncllm.kernels.silu_mul import silu_and_mul
from asyncllm.worker.gemm_layout import graph_time_us
from tests.kernels.decode_layer_cases import LayerCase, make_case

SHAPES = {  # hidden, heads, KV heads, head_dim, intermediate, layers
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 28),
    "qwen3-8b": (4096, 32, 8, 128, 12288, 36),
    "tiny": (256, 2, 1, 128, 256, 28),  # weights of no account: what a layer costs beyond its bytes
}
PEAK_TBS = {"H100": 3.35, "H200": 4.8}


def chain(pa, case: LayerCase, seq_lens: torch.Tensor, scale: float, bufs: dict, prefetch: bool) -> None:
    """One layer as the engine launches it today (the kernels of layers/ and attention/triton_backend.py).
    `prefetch`: each one-row GEMV asks L2 for its weights before it waits on the kernel before (`linear_gemv`),
    and the attention is a programmatic dependent too (o_proj's GEMV starting during it): ASYNCLLM_DECODE_PDL's."""
    w, rows = case.w, case.x.shape[0]
    eps = w.eps
    if rows == 1:
        locks = bufs["locks"]  # zeroed split-K counters, shared (each GEMV leaves them zero)
        qkv, h0 = gemv.rms_norm_gemv(
            case.x, w.input_norm, eps, w.qkv, residual=case.residual, locks=locks, pdl=True, prefetch=prefetch
        )
    else:
        h0 = case.residual.clone()
        qkv = F.linear(rms_norm(case.x, w.input_norm, eps, residual=h0), w.qkv)
    q = qk_norm_rope_kv(qkv, case.positions, case.cos, case.sin, case.k_cache, case.v_cache, case.slot_mapping,
                        w.q_norm, w.k_norm, eps, q_out=bufs["q"], pdl=rows == 1)  # fmt: skip
    attn = bufs["attn"]
    pa.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, seq_lens, bufs["qsl"], bufs["seqs"],
                              attn, scale, bufs["splits"], counters=bufs["counters"],
                              pdl=prefetch and rows == 1)  # fmt: skip
    if rows == 1:
        o = gemv.linear_gemv(attn.view(1, -1), w.o, locks=locks, pdl=True, prefetch=prefetch)
        gate_up, _ = gemv.rms_norm_gemv(o, w.post_norm, eps, w.gate_up, residual=h0, locks=locks, pdl=True,
                                        prefetch=prefetch)  # fmt: skip
        gemv.silu_mul_gemv(gate_up, w.down, locks=locks, pdl=True, prefetch=prefetch)
    else:
        o = F.linear(attn.view(rows, -1), w.o)
        gate_up = F.linear(rms_norm(o, w.post_norm, eps, residual=h0), w.gate_up)
        F.linear(silu_and_mul(gate_up), w.down)


def parse_variant(variant: str) -> tuple[int, int, int, str, bool, int, bool]:
    """warps:stages:KiB[:prefetch[:pieces]][+pre] (prefetch one of PREFETCH_MODES, off when absent; "ahead+next":
    each launch also asks for the next layer's qkv tiles; "+pre": DecodeLayerConfig.preload) -> warps, stages,
    KiB, mode, next, pieces, preload."""
    preload = variant.endswith("+pre")
    fields = variant.removesuffix("+pre").split(":")
    if len(fields) >= 4 and fields[3] in ("0", "1"):  # the older spelling: 1, the whole layer at the start
        fields[3] = ("off", "lines")[int(fields[3])]
    pieces = int(fields.pop()) if len(fields) == 5 else 1  # a fifth field: copy-engine requests a tile
    nxt = len(fields) == 4 and fields[3] == "ahead+next"
    if nxt:
        fields[3] = "ahead"
    well_formed = len(fields) in (3, 4) and all(v.isdigit() for v in fields[:3])
    if not well_formed or (fields[3:] and fields[3] not in PREFETCH_MODES):
        raise SystemExit(f"--variants {variant!r}: expected warps:stages:KiB[:prefetch] (prefetch one of "
                         f"{PREFETCH_MODES}), e.g. 4:1:32 or 4:1:32:ahead")  # fmt: skip
    warps, stages, step_kib = (int(v) for v in fields[:3])
    return warps, stages, step_kib, fields[3] if len(fields) == 4 else "off", nxt, pieces, preload


def variant_config(w: dl.DecodeLayerWeights, rows: int, sms: int, variant: str) -> tuple[dl.DecodeLayerConfig, bool]:
    """The variant's config for these weights, and whether each launch asks for the next layer's qkv."""
    warps, stages, step_kib, prefetch, nxt, pieces, preload = parse_variant(variant)
    config = dl.plan_config(w, rows, sms, step_kib << 10, warps, stages, prefetch, preload)
    return dl.DecodeLayerConfig(**{**vars(config), "prefetch_pieces": pieces}), nxt


def next_qkv(cases: list[LayerCase], i: int, nxt: bool) -> torch.Tensor | None:
    """The layer after layer i's qkv weight where the variant asks for it (the first layer's after the last)."""
    return cases[(i + 1) % len(cases)].w.qkv if nxt else None


def run(shape: str, rows: int, context: int, variant: str) -> dict:
    hidden, heads, kv_heads, dim, inter, layers = SHAPES[shape]
    cases = [make_case([context] * rows, hidden, heads, kv_heads, dim, inter, dtype=torch.bfloat16, device="cuda",
                       seed=i) for i in range(layers)]  # fmt: skip
    scale = dim**-0.5
    seq_lens = torch.full((rows,), context, dtype=torch.int32, device="cuda")
    scratch = dl.DecodeLayerScratch(cases[0].w, rows, torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config, nxt = variant_config(cases[0].w, rows, sms, variant)
    c = cases[0]
    k_ref, v_ref = c.k_cache.clone(), c.v_cache.clone()
    want, want_h1 = dl.decode_layer_ref(*c.with_caches(k_ref, v_ref).args()[:-1], c.seq_lens, scale)
    got, got_h1 = dl.decode_layer(*c.with_caches(c.k_cache.clone(), c.v_cache.clone()).args(), scale, scratch,
                                  config=config)  # fmt: skip
    torch.testing.assert_close(got_h1, want_h1, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    fused = [partial(dl.decode_layer, *k.args(), scale, scratch, config=config, next_qkv=next_qkv(cases, i, nxt))
             for i, k in enumerate(cases)]  # fmt: skip
    pa = load_paged_attention()
    bufs = {
        "q": torch.empty(rows, heads, dim, dtype=torch.bfloat16, device="cuda"),
        "attn": torch.empty(rows, heads, dim, dtype=torch.bfloat16, device="cuda"),
        "qsl": torch.arange(rows + 1, dtype=torch.int32, device="cuda"),
        "seqs": torch.arange(rows, dtype=torch.int32, device="cuda"),
        "splits": choose_num_splits(context, rows, kv_heads, sms),
        "counters": torch.zeros(rows * kv_heads, dtype=torch.int32, device="cuda"),
        "locks": gemv.gemv_locks(2 * inter, 1, torch.device("cuda")),
    }
    engine = [partial(chain, pa, k, seq_lens, scale, bufs, False) for k in cases]
    engine_prefetch = [partial(chain, pa, k, seq_lens, scale, bufs, True) for k in cases]
    fused_us = graph_time_us(fused, calls=layers)
    engine_us = graph_time_us(engine, calls=layers)
    prefetch_us = graph_time_us(engine_prefetch, calls=layers)
    weight_bytes = sum(t.numel() * t.element_size() for t in (c.w.qkv, c.w.o, c.w.gate_up, c.w.down))
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TBS.items() if k in name), 3.35)
    return {"shape": shape, "rows": rows, "context": context, "device": name,
            "fused_us_per_layer": round(fused_us, 2), "engine_us_per_layer": round(engine_us, 2),
            "engine_prefetch_us_per_layer": round(prefetch_us, 2),
            "engine_over_fused": round(engine_us / fused_us, 3),
            "limit_us": round(weight_bytes / (peak * 1e12) * 1e6, 2), "config": vars(config)}  # fmt: skip


def phase_breakdown(shape: str, rows: int, context: int, variant: str, splits: int | None = None) -> dict:
    """Where one launch's time goes: every layer run once with each program's clock stamped at its start, at
    each barrier's arrival and return, and at its end (`decode_layer(clock=...)`); medians over the layers but
    the first, in us: each phase from the last program's return from the barrier before (or the first
    program's start) to the last arrival at the barrier after (the end, for the last); each barrier from its
    last arrival to its last return; the programs' start skew."""
    hidden, heads, kv_heads, dim, inter, layers = SHAPES[shape]
    cases = [make_case([context] * rows, hidden, heads, kv_heads, dim, inter, dtype=torch.bfloat16, device="cuda",
                       seed=i) for i in range(layers)]  # fmt: skip
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config, nxt = variant_config(cases[0].w, rows, sms, variant)
    scratch = dl.DecodeLayerScratch(cases[0].w, rows, torch.device("cuda"))
    clocks = [torch.zeros(sms, dl.STAMPS, dtype=torch.int64, device="cuda") for _ in cases]
    for _ in range(2):  # the first pass compiles
        for i, (case, clock) in enumerate(zip(cases, clocks)):
            dl.decode_layer(*case.args(), dim**-0.5, scratch, num_splits=splits, config=config, clock=clock,
                            next_qkv=next_qkv(cases, i, nxt))  # fmt: skip
    torch.cuda.synchronize()
    per_layer = []
    for clock in clocks[1:]:
        t = clock.double().cpu() / 1e3  # us
        arrive, leave = t[:, 1:9:2].max(0).values, t[:, 2:9:2].max(0).values  # [4]
        begins = torch.cat([t[:, 0].min().view(1), leave])
        ends = torch.cat([arrive, t[:, 9].max().view(1)])
        per_layer.append(torch.cat([ends - begins, leave - arrive, (t[:, 9].max() - t[:, 0].min()).view(1),
                                    (t[:, 0].max() - t[:, 0].min()).view(1)]))  # fmt: skip
    med = torch.stack(per_layer).median(0).values.tolist()
    return {"shape": shape, "rows": rows, "context": context, "variant": variant, "splits": splits or "auto",
            "phase_us": [round(v, 2) for v in med[:5]], "barrier_us": [round(v, 2) for v in med[5:9]],
            "launch_us": round(med[9], 2), "start_skew_us": round(med[10], 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-8b"], choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--context", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--variants", nargs="+", default=["4:1:32"],
                        help="warps:stages:KiB a K step[:prefetch mode[:pieces]][+pre]")  # fmt: skip
    parser.add_argument("--timing", action="store_true", help="each phase's and barrier's time instead (clock stamps)")
    parser.add_argument("--splits", nargs="+", type=int, default=[0], help="--timing: KV splits a row and KV head "
                        "(0: the launcher's, one item a program)")  # fmt: skip
    args = parser.parse_args()
    if args.timing:
        for shape in args.shapes:
            for rows in args.rows:
                for context in args.context:
                    for variant in args.variants:
                        for splits in args.splits:
                            row = phase_breakdown(shape, rows, context, variant, splits or None)
                            print(json.dumps(row), flush=True)
        return
    for shape in args.shapes:
        for rows in args.rows:
            for context in args.context:
                for variant in args.variants:
                    print(json.dumps(run(shape, rows, context, variant)), flush=True)


if __name__ == "__main__":
    main()
