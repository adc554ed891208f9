"""Real model shapes for benchmarks: a config.json (random weights via load_format="dummy") plus the real
tokenizer, so detokenization costs what it costs in production. Numbers from ../shared/PERF.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        eos_token_id=151645,
        bos_token_id=151643,
        hidden_act="silu",
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        eos_token_id=151645,
        bos_token_id=151643,
        hidden_act="silu",
    ),
    # Qwen3-30B-A3B: 48 layers of 128 experts (top 8, renormalised; each expert's FFN 768), 30.5B parameters of
    # which 3.3B are active per token; 61 GB in bfloat16.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        eos_token_id=151645,
        bos_token_id=151643,
        hidden_act="silu",
    ),
}
# Not a real model: the Qwen3 architecture at toy size (the real tokenizer, so its vocabulary), for CPU smoke
# runs of the benchmark scripts (`--shape qwen3-tiny --device cpu`).
SHAPES["qwen3-tiny"] = (
    SHAPES["qwen3-0.6b"]
    | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    | dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
)
SHAPES["qwen3-moe-tiny"] = (  # likewise for Qwen3-MoE: 8 experts, top 2
    SHAPES["qwen3-30b-a3b"]
    | dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    | dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
)
# Gemma 3 4B's language model (google/gemma-3-4b-it's text_config) as the text-only Gemma3ForCausalLM: 34
# layers, five of them global (every sixth), the rest sliding over 1,024 keys; tied 262k-row embedding. No Gemma
# tokenizer is at hand offline: the Qwen3 one stands in (ids past its vocabulary decode to nothing), so
# detokenization costs about what it costs for Qwen3.
SHAPES["gemma3-4b"] = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    hidden_size=2560,
    intermediate_size=10240,
    num_hidden_layers=34,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    vocab_size=262208,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    rope_scaling=dict(rope_type="linear", factor=8.0),
    query_pre_attn_scalar=256,
    sliding_window=1024,
    sliding_window_pattern=6,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    eos_token_id=[1, 106],
    bos_token_id=2,
    pad_token_id=0,
)
# The Gemma 3 architecture at toy size with its real vocabulary, for CPU smoke runs (`--shape gemma3-tiny`).
SHAPES["gemma3-tiny"] = SHAPES["gemma3-4b"] | dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=16, sliding_window_pattern=3,
)  # fmt: skip
# Physical limits on one H200 for W1 (output tok/s), from ../shared/PERF.md; Gemma 3 4B's from
# bench/gemma3_w1_w5.py's byte count (weights once per decode step plus every sequence's KV reads).
W1_LIMIT = {"qwen3-0.6b": 36_400, "qwen3-8b": 13_000, "gemma3-4b": 24_500}


def find_qwen3_tokenizer() -> Path:
    here = Path(__file__).resolve().parents[1]
    for cand in (
        here / ".cache" / "qwen3-tokenizer",
        here / ".peers" / "qwen3-tokenizer",  # carried to the device machine
        here.parent / "shared" / "models" / "qwen3-tokenizer",
    ):
        if (cand / "tokenizer.json").is_file():
            return cand
    raise FileNotFoundError("Qwen3 tokenizer not found in .cache/, .peers/ or ../shared/models/")


def write_shape_dir(shape: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    for f in find_qwen3_tokenizer().iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out
