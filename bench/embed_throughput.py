"""Embedding throughput: asyncllm's embed engine beside a batched transformers forward, on random weights.

10,000 texts of 128-512 tokens (random token ids from a seeded generator) through
(a) `LLM(..., task="embed", load_format="dummy").embed(ids)`: the engine's own batching by token budget;
(b) transformers (bf16 on CUDA, SDPA attention), texts sorted by length, batched by a token budget (padded
    tokens included), each batch's outputs pooled as sentence-transformers would: the last token for the
    Qwen3 shape (Qwen3-Embedding), the masked mean for BERT (all-MiniLM-like), then L2-normalised.
Shapes: Qwen3-0.6B (`qwen3`) and BERT-base (`bert`), or toy ones with `--tiny` (CPU-sized: the test runs
them). Prints one JSON line per shape: texts/s of each and the ratio (asyncllm / transformers). Random
weights on both sides, not the same ones: the figures are throughput only. Figures in bench/RESULTS.md.

    python bench/embed_throughput.py                      # CUDA, both shapes, full size
    python bench/embed_throughput.py --tiny --device cpu  # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from shapes import SHAPES

# Qwen3-Embedding-0.6B: the Qwen3-0.6B shape (bench/shapes.py) with the embedder's vocabulary and context.
QWEN3_06B: dict[str, Any] = {
    k: v for k, v in SHAPES["qwen3-0.6b"].items() if k not in ("eos_token_id", "bos_token_id")
} | dict(vocab_size=151669, max_position_embeddings=32768)
BERT_BASE: dict[str, Any] = dict(
    architectures=["BertModel"],
    model_type="bert",
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    vocab_size=30522,
    max_position_embeddings=512,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
    torch_dtype="float32",
)
TINY = {
    "qwen3": QWEN3_06B
    | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    | dict(head_dim=16, vocab_size=1024, max_position_embeddings=512),
    "bert": BERT_BASE | dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
}
FULL = {"qwen3": QWEN3_06B, "bert": BERT_BASE}
NAMES = {"qwen3": "qwen3-0.6b", "bert": "bert-base"}


def texts(num: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """`num` inputs of `lo`-`hi` random token ids (ids from 1: 0 is BERT's padding)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices sorted by length (longest first), cut into batches whose padded size (count x longest) stays
    within `budget` tokens (a text longer than the budget is a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def run_asyncllm(config: dict[str, Any], inputs: list[list[int]], device: str, dtype: str) -> float:
    """Seconds for the engine to embed `inputs` (after a warm-up call)."""
    from asyncllm import LLM

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        llm = LLM(d, task="embed", load_format="dummy", device=device, dtype=dtype)
    try:
        llm.embed(inputs[:64])
        _sync(device)
        start = time.perf_counter()
        out = llm.embed(inputs)
        _sync(device)
        seconds = time.perf_counter() - start
        assert len(out) == len(inputs)
        return seconds
    finally:
        llm.shutdown()


def run_transformers(config: dict[str, Any], inputs: list[list[int]], device: str, dtype: str, budget: int) -> float:
    """Seconds for a batched transformers forward, pooled and normalised, over `inputs` (after a warm-up)."""
    import transformers

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    torch_dtype = getattr(torch, dtype)
    model = transformers.AutoModel.from_config(hf_config, attn_implementation="sdpa", dtype=torch_dtype)
    model = model.to(device).eval()
    last_token = config["model_type"] != "bert"
    batches = token_batches([len(x) for x in inputs], budget)

    @torch.inference_mode()
    def embed(batch: list[int]) -> torch.Tensor:
        rows = [inputs[i] for i in batch]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row)
            mask[r, : len(row)] = 1
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, width, hidden]
        if last_token:  # right padding: each text's last real token
            pooled = hidden[torch.arange(len(rows), device=device), mask.sum(1) - 1]
        else:  # sentence-transformers' mean over the real tokens
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(pooled.float(), dim=-1)

    embed(batches[0][:8])
    _sync(device)
    start = time.perf_counter()
    for batch in batches:
        embed(batch)
    _sync(device)
    return time.perf_counter() - start


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    """Give back what the last run held before the next one is measured."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["qwen3", "bert", "all"], default="all")
    parser.add_argument("--tiny", action="store_true", help="toy shapes and 32 texts of 8-48 tokens (CPU smoke)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-texts", type=int, default=None, help="default 10,000 (32 with --tiny)")
    parser.add_argument("--min-len", type=int, default=None, help="default 128 (8 with --tiny)")
    parser.add_argument("--max-len", type=int, default=None, help="default 512 (48 with --tiny)")
    parser.add_argument("--budget", type=int, default=16384, help="transformers' padded tokens per batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    num = args.num_texts or (32 if args.tiny else 10_000)
    lo, hi = args.min_len or (8 if args.tiny else 128), args.max_len or (48 if args.tiny else 512)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    shapes = TINY if args.tiny else FULL
    for key in ["qwen3", "bert"] if args.shape == "all" else [args.shape]:
        config = shapes[key]
        inputs = texts(num, lo, min(hi, config["max_position_embeddings"]), config["vocab_size"], args.seed)
        ours = run_asyncllm(config, inputs, args.device, dtype)
        _free(args.device)
        theirs = run_transformers(config, inputs, args.device, dtype, args.budget)
        _free(args.device)
        line = {
            "shape": NAMES[key] + ("-tiny" if args.tiny else ""),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "dtype": dtype,
            "texts": num,
            "tokens": sum(map(len, inputs)),
            "asyncllm_texts_per_s": round(num / ours, 2),
            "transformers_texts_per_s": round(num / theirs, 2),
            "ratio": round(theirs / ours, 3),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
