"""Micro-benchmark of the varlen Triton attention kernel (kernels/varlen_attention.py): packed ragged
sequences, no KV cache. Prints one JSON line per case.

Cases: BERT-base heads (12 x 64) bidirectional, and Qwen3-0.6B heads (16 query / 8 KV, 128) bidirectional and
causal, over 64 sequences of U[128, 512] tokens (issue 43's embedding workload), bfloat16. Beside the kernel:
PyTorch's own FlashAttention-2 varlen forward on the same packed tensors (the speed to match), and
scaled_dot_product_attention on the batch padded to its longest sequence with a key mask (what a padded
transformers forward runs). max_err is against the kernel's torch twin (varlen_attention_ref, float32).
Run on the device machine from the repo root: python3 bench/kernels/bench_varlen_attention.py
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

DEVICE = "cuda"
DTYPE = torch.bfloat16
# name -> (query heads, KV heads, head_dim)
SHAPES = {"bert-base": (12, 12, 64), "qwen3-0.6b": (16, 8, 128)}
CASES = [("bert-base", False), ("qwen3-0.6b", False), ("qwen3-0.6b", True)]


def time_ms(fn: Callable[[], object], repeats: int = 20) -> float:
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


def ragged(num_seqs: int, lo: int, hi: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (num_seqs,), generator=gen).tolist()


def padded_sdpa(q, k, v, lens: list[int], scale: float, causal: bool) -> Callable[[], torch.Tensor]:
    """SDPA over [B, H, L, D] padded to the longest sequence, padding keys masked (and causal)."""
    heads, longest = q.shape[1], max(lens)

    def dense(x: torch.Tensor) -> torch.Tensor:  # [T, h, D] -> [B, H, L, D], KV heads repeated for GQA
        out = x.new_zeros(len(lens), longest, heads, x.shape[2])
        for i, chunk in enumerate(x.repeat_interleave(heads // x.shape[1], dim=1).split(lens)):
            out[i, : len(chunk)] = chunk
        return out.transpose(1, 2)

    qd, kd, vd = dense(q), dense(k), dense(v)
    keep = torch.arange(longest, device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None]
    mask = keep[:, None, None, :]  # [B, 1, 1, L]
    if causal:
        mask = mask & torch.ones(longest, longest, dtype=torch.bool, device=q.device).tril()
    return lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)


def flash_varlen(q, k, v, cu, longest: int, scale: float, causal: bool) -> Callable[[], torch.Tensor]:
    """PyTorch's FlashAttention-2 varlen forward (CUDA only), KV heads repeated if it wants them so."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    op = torch.ops.aten._flash_attention_forward

    def run() -> torch.Tensor:
        return op(q, kk, vv, cu, cu, longest, longest, 0.0, causal, False, scale=scale)[0]

    return run


def bench_case(va, name: str, causal: bool, lens: list[int]) -> dict[str, object]:
    heads, kv_heads, head_dim = SHAPES[name]
    torch.manual_seed(0)
    total = sum(lens)
    q = torch.randn(total, heads, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(total, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v = torch.randn(total, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale, longest = head_dim**-0.5, max(lens)
    out = va.varlen_attention(q, k, v, cu, longest, scale, causal)
    ref = va.varlen_attention_ref(q, k, v, lens, scale, causal)
    ms = time_ms(lambda: va.varlen_attention(q, k, v, cu, longest, scale, causal, out=out))
    flops = 4 * sum(n * n for n in lens) * heads * head_dim * (0.5 if causal else 1.0)
    result: dict[str, object] = {
        "kernel": "varlen_attention",
        "shape": f"{name} {heads}q/{kv_heads}kv d{head_dim}, {len(lens)} seqs U[{min(lens)}, {longest}] "
        f"({total} tokens), {'causal' if causal else 'bidirectional'}, {str(DTYPE).removeprefix('torch.')}",
        "ms": round(ms, 4),
        "tflop_s": round(flops / ms / 1e9, 1),
        "max_err": round((out.float() - ref.float()).abs().max().item(), 4),
    }
    sdpa_ms = time_ms(padded_sdpa(q, k, v, lens, scale, causal))
    result.update(padded_sdpa_ms=round(sdpa_ms, 4), speed_vs_padded_sdpa=round(sdpa_ms / ms, 2))
    try:
        flash_ms = time_ms(flash_varlen(q, k, v, cu, longest, scale, causal))
        result.update(flash_varlen_ms=round(flash_ms, 4), speed_vs_flash_varlen=round(flash_ms / ms, 2))
    except (RuntimeError, NotImplementedError) as err:  # no CUDA, or no flash kernel in this torch build
        result["flash_varlen"] = f"unavailable: {type(err).__name__}: {str(err)[:100]}"
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_varlen_attention needs a CUDA device")
    from asyncllm.kernels import varlen_attention as va

    lens = ragged(args.seqs, args.min_len, args.max_len, seed=0)
    for name, causal in CASES:
        print(json.dumps(bench_case(va, name, causal, lens)), flush=True)


if __name__ == "__main__":
    main()
