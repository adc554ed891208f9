"""The value sets of the engine arguments that take one of a few names (device, dtype, load format,
quantization, KV-cache dtype, attention backend): each a `str` enum, so users pass plain strings and
`config.py` checks them with `check_enum`. Plain Python; no torch.
"""

from __future__ import annotations

import enum

__all__ = [
    "KV_CACHE_DTYPES_REFUSED",
    "AttentionBackendName",
    "DType",
    "Device",
    "KVCacheDType",
    "LoadFormat",
    "Quantization",
]


class Device(str, enum.Enum):
    """Where the model executes (`DeviceConfig.device`)."""

    AUTO = "auto"
    CUDA = "cuda"
    CPU = "cpu"


class DType(str, enum.Enum):
    """The precision of weights, activations and KV cache (`ModelConfig.dtype`)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class LoadFormat(str, enum.Enum):
    """Where the weights come from (`ModelConfig.load_format`)."""

    AUTO = "auto"  # read the checkpoint's weights
    DUMMY = "dummy"  # random weights of the checkpoint's shape (benchmarks; needs config.json only)


class Quantization(str, enum.Enum):
    """How the weights are quantized on the device (`ModelConfig.quantization`); docs/quantization.md."""

    FP8 = "fp8"  # e4m3 weights: an FP8 checkpoint's, or a 16-bit checkpoint's quantized at load
    AWQ = "awq"  # an AWQ int4 checkpoint
    GPTQ = "gptq"  # a GPTQ int4/int8 checkpoint
    GGUF = "gguf"  # a GGUF file's Q8_0 / Q4_0 / Q4_1 linear layers kept quantized (the default on CUDA)


class Task(str, enum.Enum):
    """What the engine serves (`ModelConfig.task`); vLLM's runner/convert names. docs/embeddings.md."""

    GENERATE = "generate"  # text: add_request, stream, generate, chat
    EMBED = "embed"  # vectors: embed (and score as cosine similarity)
    SCORE = "score"  # relevance: score, rerank (a cross-encoder or a yes/no reranker)


class KVCacheDType(str, enum.Enum):
    """What the paged KV cache stores (`CacheConfig.kv_cache_dtype`); vLLM's names. docs/quantization.md."""

    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # e4m3 codes, one byte each, with a float32 scale per layer for keys and one for values
    FP8_E4M3 = "fp8_e4m3"  # the same, by its format's name


# Names vLLM accepts that asyncllm refuses, with the reason given to whoever passes them.
KV_CACHE_DTYPES_REFUSED = {
    "fp8_e5m2": "e5m2 keeps 2 mantissa bits to e4m3's 3 (twice the rounding error) and is read without scales; "
    "asyncllm's FP8 cache is e4m3: use 'fp8' (or 'fp8_e4m3')",
}


class AttentionBackendName(str, enum.Enum):
    """Which attention implementation runs the model (`DeviceConfig.attention_backend`)."""

    AUTO = "auto"  # the fastest available for the device
    TORCH = "torch"  # the pure-PyTorch reference every kernel is checked against
    TRITON = "triton"  # the paged Triton kernels (CUDA; on CPU only in Triton's interpreter)
