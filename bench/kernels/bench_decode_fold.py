"""The decode reduce folded into the split kernel (one launch: `paged_decode_attention(..., counters=...)`)
against split + reduce (two launches), as the engine runs them: inside a CUDA graph of LAYERS back-to-back
decode attentions (launch gaps included), Qwen3-0.6B's heads (16 query / 8 KV, head_dim 128), bf16, blocks of
16, sequences longest first, the split count a decode graph plans for its bound (max_model_len 4,096, as
bench/w5_profile.py runs). Batches 1, 4, 16, 64, 256; lengths W5-like (uniform in [128, 640]: a 128-token
prompt and up to 512 decoded) and W1-like (uniform in [200, 2,048]). Prints one JSON line per case: us per
layer for each, fold / split+reduce, and the largest difference between their outputs.

Usage (device machine, repo root, asyncllm importable as in bench/gpu_check.sh):
  python3 bench/kernels/bench_decode_fold.py [--batches 1,4,16,64,256] [--layers 28]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from asyncllm.attention.triton_backend import load_paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK, MAX_LEN = 16, 8, 128, 16, 4096
PROFILES = {"W5": (128, 640), "W1": (200, 2048)}


def paged_batch(lens: list[int]):
    """Random bf16 caches over shuffled blocks, one query per sequence, int32 metadata, all on CUDA."""
    per_seq = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per_seq) + 1
    perm = (torch.randperm(num_blocks - 1) + 1).int()
    tables = torch.zeros(len(lens), MAX_LEN // BLOCK, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = perm[at : at + nb]
        at += nb
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    q = torch.randn(len(lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables.cuda(), seq_lens, starts


def graph_us(launch, layers: int, repeats: int = 50) -> float:
    """Microseconds per launch of `launch`, `layers` of them captured in one CUDA graph (median replay)."""
    launch()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            launch()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / layers


def bench(pa, batch: int, profile: str, layers: int, sms: int) -> dict[str, object]:
    lo, hi = PROFILES[profile]
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    q, k_cache, v_cache, tables, seq_lens, starts = paged_batch(lens)
    order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    splits = pa.choose_num_splits(MAX_LEN, batch, KV_HEADS, sms)  # a decode graph's: from the bound
    counters = torch.zeros(batch * KV_HEADS, dtype=torch.int32, device="cuda")
    outs = {name: torch.empty_like(q) for name in ("fold", "split_reduce")}
    scale = HEAD_DIM**-0.5

    def launch(name: str) -> None:
        args = (q, k_cache, v_cache, tables, seq_lens, starts, order, outs[name], scale)
        pa.paged_decode_attention(*args, num_splits=splits, counters=counters if name == "fold" else None)

    us = {name: graph_us(lambda name=name: launch(name), layers) for name in outs}
    assert not counters.any(), "the fold left its counters dirty"
    return {
        "case": f"batch {batch} {profile}-like U[{lo}, {hi}]",
        "num_splits": splits,
        "split_reduce_us": round(us["split_reduce"], 2),
        "fold_us": round(us["fold"], 2),
        "fold_over_split_reduce": round(us["fold"] / us["split_reduce"], 3),
        "max_abs_diff": round((outs["fold"].float() - outs["split_reduce"].float()).abs().max().item(), 5),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--layers", type=int, default=28, help="decode attentions per captured graph (Qwen3-0.6B: 28)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_fold needs a CUDA device")
    pa = load_paged_attention()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    for profile in PROFILES:
        for batch in (int(b) for b in args.batches.split(",")):
            print(json.dumps(bench(pa, batch, profile, args.layers, sms)), flush=True)


if __name__ == "__main__":
    main()
