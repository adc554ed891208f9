"""Micro-benchmark of the paged Triton attention kernels (kernels/paged_attention.py), Qwen3-0.6B heads
(16 query / 8 KV heads, head_dim 128), bfloat16, shuffled blocks of 16. Prints one JSON line per result.

decode: batch 256 x context 1,024; limit: reading the KV once at the H200's copy bandwidth (`COPY_TB_S`;
../shared/PERF.md target: >= 80 %). A few launch configurations side by side, and the torch reference.
prefill: causal, equal-length sequences; against torch's scaled_dot_product_attention on dense [B, H, L, D]
(its flash path), and torch.nn.attention.varlen where this torch has it (target: >= 0.9x).
decode-fp8 (`--kv-fp8`): the default decode launch over the same keys and values in bf16 and in e4m3 (an FP8 KV
cache, kv_cache_dtype="fp8": half the bytes to read).
Run on the device machine from the repo root: python3 bench/kernels/bench_paged_attention.py [--kv-fp8]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from asyncllm.attention.triton_backend import load_paged_attention

COPY_TB_S = 4.25  # measured H200 copy bandwidth (read + write), ../shared/PERF.md
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def time_ms(fn, repeats: int = 30) -> float:
    """Median of CUDA-event timings after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paged_batch(seq_lens: list[int], query_lens: list[int]):
    """Random bf16 cache over shuffled blocks, packed queries and int32 metadata, all on CUDA."""
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    perm = (torch.randperm(num_blocks - 1) + 1).int()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = perm[at : at + nb]
        at += nb
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    return q, k_cache, v_cache, tables.cuda(), torch.tensor(seq_lens, dtype=torch.int32).cuda(), starts


def _contexts(batch: int, context: int, min_context: int | None) -> list[int]:
    torch.manual_seed(0)
    if min_context is None:
        return [context] * batch
    # W1-like: lengths uniform in [min_context, context], so programs end at different times
    return torch.randint(min_context, context + 1, (batch,)).tolist()


def bench_decode(pa, batch: int, context: int, min_context: int | None = None) -> None:
    contexts = _contexts(batch, context, min_context)
    q, k_cache, v_cache, tables, lens, starts = paged_batch(contexts, [1] * batch)
    seqs = torch.arange(batch, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * sum(contexts) * KV_HEADS * HEAD_DIM * 2  # K and V, bf16, each read once
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = pa.choose_num_splits(max(contexts), batch, KV_HEADS, sms)
    args = (q, k_cache, v_cache, tables, lens, starts, seqs, out, scale)
    variants = {"default": dict(num_splits=chosen)}
    for splits in sorted({1, 2, 4}):
        for block_n, warps, stages in (
            (32, 4, 2),
            (32, 4, 4),
            (64, 4, 2),
            (64, 4, 3),
            (64, 4, 4),
            (128, 8, 2),
            (128, 4, 3),
            (64, 8, 3),
        ):
            variants[f"s{splits}-n{block_n}-w{warps}-st{stages}"] = dict(
                num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages
            )
    ref = pa.paged_attention_ref(q, k_cache, v_cache, tables, [1] * batch, contexts, scale)
    # The engine hands the kernel its sequences longest first; "-batch-order" keeps the batch's own order.
    longest_first = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
    orders = {"": longest_first, "-batch-order": seqs}
    results = {}
    for (name, cfg), (suffix, order) in itertools.product(variants.items(), orders.items()):
        if suffix and not (name == "default" or cfg["num_stages"] == 2):
            continue  # batch order only for the default and the 2-stage variants
        run_args = (*args[:6], order, *args[7:])
        out.fill_(float("nan"))
        pa.paged_decode_attention(*run_args, **cfg)
        err = (out.float() - ref.float()).abs().max().item()
        ms = time_ms(lambda cfg=cfg, run_args=run_args: pa.paged_decode_attention(*run_args, **cfg))
        results[name + suffix] = dict(ms=round(ms, 4), tb_s=round(kv_bytes / ms / 1e9, 3), max_err=round(err, 4))
    best = min(results, key=lambda k: results[k]["ms"])
    from asyncllm.attention.torch_ref import TorchAttentionBackend  # the reference's batched decode path

    torch_ms = _torch_decode_ms(TorchAttentionBackend(), q, k_cache, v_cache, tables, lens, starts, scale)
    default = results["default"]
    print(
        json.dumps(
            {
                "kernel": "decode",
                "shape": f"batch {batch} x context {context if min_context is None else f'U[{min_context}, {context}]'}"
                f", 16q/8kv heads, d128, bf16, block {BLOCK}",
                "kv_bytes": kv_bytes,
                "num_splits_chosen": chosen,
                "ms": default["ms"],
                "kv_tb_s": default["tb_s"],
                "percent_of_copy_bw": round(100 * default["tb_s"] / COPY_TB_S, 1),
                "best_variant": best,
                "best_percent_of_copy_bw": round(100 * results[best]["tb_s"] / COPY_TB_S, 1),
                "torch_ref_ms": round(torch_ms, 3),
            }
        )
    )
    print(json.dumps({"kernel": "decode-variants", "variants": results}))


def bench_decode_fp8(pa, batch: int, context: int, min_context: int | None = None) -> None:
    """The engine's decode launch (its split count, longest first) over one batch's keys and values stored in
    bfloat16 and in e4m3 with non-unit scales: time, bytes read per second, error against the reference."""
    contexts = _contexts(batch, context, min_context)
    q, k_cache, v_cache, tables, lens, starts = paged_batch(contexts, [1] * batch)
    scales = dict(k_scale=torch.tensor(0.5, device="cuda"), v_scale=torch.tensor(0.25, device="cuda"))
    k8, v8 = (c.div(scales[n]).to(torch.float8_e4m3fn) for c, n in ((k_cache, "k_scale"), (v_cache, "v_scale")))
    out, scale = torch.empty_like(q), HEAD_DIM**-0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = pa.choose_num_splits(max(contexts), batch, KV_HEADS, sms)
    order = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
    row = dict(kernel="decode-fp8", shape=f"batch {batch} x context {context}, 16q/8kv heads, d128, bf16 queries")
    for name, caches, extra in (("bf16", (k_cache, v_cache), {}), ("e4m3", (k8, v8), scales)):
        args = (q, *caches, tables, lens, starts, order, out, scale)
        ms = time_ms(lambda args=args, extra=extra: pa.paged_decode_attention(*args, num_splits=splits, **extra))
        ref = pa.paged_attention_ref(q, *caches, tables, [1] * batch, contexts, scale, **extra)
        kv_bytes = 2 * sum(contexts) * KV_HEADS * HEAD_DIM * caches[0].element_size()
        row |= {f"{name}_ms": round(ms, 4), f"{name}_tb_s": round(kv_bytes / ms / 1e9, 3)}
        row[f"{name}_max_err"] = round((out.float() - ref.float()).abs().max().item(), 4)
    row["e4m3_speedup"] = round(row["bf16_ms"] / row["e4m3_ms"], 3)
    print(json.dumps(row))


def _torch_decode_ms(backend, q, k_cache, v_cache, tables, lens, starts, scale) -> float:
    """The torch reference backend's forward on the same decode step (nothing new to store)."""
    from asyncllm.attention.backend import AttentionMetadata

    n = q.shape[0]
    no_slots = torch.zeros(0, dtype=torch.int64, device="cuda")
    meta = AttentionMetadata(starts, lens, tables, no_slots, [1] * n, lens.tolist(), 1, int(lens.max()))
    backend.plan_and_upload(meta)
    kv = torch.empty(0, KV_HEADS, HEAD_DIM, device="cuda", dtype=q.dtype)
    return time_ms(lambda: backend.forward(q, kv, kv, k_cache, v_cache, meta, scale), repeats=5)


def bench_prefill(pa, batch: int, length: int) -> None:
    torch.manual_seed(1)
    q, k_cache, v_cache, tables, lens, starts = paged_batch([length] * batch, [length] * batch)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    block_m = pa.prefill_block_m(torch.bfloat16, q.device)
    tiles = torch.tensor(
        pa.tile_buffer(pa.plan_prefill_tiles([length] * batch, [length] * batch, block_m)), dtype=torch.int32
    )
    args = (q, k_cache, v_cache, tables, lens, starts, tiles.cuda(), out, scale)
    ms = time_ms(lambda: pa.paged_prefill_attention(*args, block_m=block_m))
    flops = 4 * batch * HEADS * HEAD_DIM * length * length / 2  # causal: half of QK^T and PV
    # The same keys/values, dense and contiguous, for torch: [B, H, L, D] with KV heads repeated for GQA.
    rows = tables[:, : length // BLOCK].long()
    k = k_cache[rows].flatten(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=2).transpose(1, 2).contiguous()
    v = v_cache[rows].flatten(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=2).transpose(1, 2).contiguous()
    qd = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale))
    expected = F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale).transpose(1, 2).flatten(0, 1)
    pa.paged_prefill_attention(*args, block_m=block_m)
    result = {
        "kernel": "prefill",
        "shape": f"{batch} x {length} tokens causal, 16q/8kv heads, d128, bf16, block {BLOCK}",
        "ms": round(ms, 3),
        "tflop_s": round(flops / ms / 1e9, 1),
        "sdpa_ms": round(sdpa_ms, 3),
        "speed_vs_sdpa": round(sdpa_ms / ms, 2),
        "max_err_vs_sdpa": round((out.float() - expected.float()).abs().max().item(), 4),
    }
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        causal = dict(is_causal=True) if "is_causal" in params else dict(window_size=(-1, 0))  # 2.9-2.10 / later
        extra = dict(scale=scale) if "scale" in params else {}
        qp, kp, vp = (x.transpose(1, 2).flatten(0, 1) for x in (qd, k, v))  # packed [B*L, H, D]
        varlen_ms = time_ms(lambda: varlen_attn(qp, kp, vp, starts, starts, length, length, **causal, **extra))
        result.update(varlen_ms=round(varlen_ms, 3), speed_vs_varlen=round(varlen_ms / ms, 2))
    except (ImportError, TypeError, RuntimeError) as err:  # absent in this torch, or another signature
        result["varlen"] = f"unavailable: {type(err).__name__}: {str(err)[:120]}"
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--min-context", type=int, default=None, help="lengths uniform in [this, --context]")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--kv-fp8", action="store_true", help="also decode over an e4m3 cache beside bf16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_paged_attention needs a CUDA device")
    pa = load_paged_attention()
    bench_decode(pa, args.batch, args.context, args.min_context)
    if args.kv_fp8:
        bench_decode_fp8(pa, args.batch, args.context, args.min_context)
    if args.decode_only:
        return
    bench_prefill(pa, 16, 1024)
    bench_prefill(pa, 2, 8192)


if __name__ == "__main__":
    main()
