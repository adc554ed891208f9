"""Engine configuration: frozen, composed dataclasses validated at construction.

Only what the user chose lives here. Facts learned at run time (the model's shape, the number of KV
blocks after profiling, EOS ids) live in runtime state (`asyncllm.core.runtime`), never written back.
Plain Python; no torch.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Device(str, enum.Enum):
    AUTO = "auto"
    CUDA = "cuda"
    CPU = "cpu"


class DType(str, enum.Enum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class LoadFormat(str, enum.Enum):
    AUTO = "auto"  # read the checkpoint's weights
    DUMMY = "dummy"  # random weights of the checkpoint's shape (benchmarks; needs config.json only)


class AttentionBackendName(str, enum.Enum):
    AUTO = "auto"  # the fastest available for the device
    TORCH = "torch"  # the pure-PyTorch reference every kernel is checked against
    TRITON = "triton"
    FLASH = "flash"


def _bad(name: str, value: object, fix: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {fix}")


def _enum(cls: type[enum.Enum], name: str, value: object) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise _bad(name, value, f"choose one of {allowed}") from None


def _positive(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        suffix = " or None" if optional else ""
        raise _bad(name, value, f"use an integer >= 1{suffix}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every engine argument of ../API.md, documented and validated.

    Build it with `EngineConfig(model=..., **engine_args)`; an unknown name raises `TypeError` naming it.
    """

    model: str
    """Local checkpoint directory (config.json, *.safetensors, tokenizer) or a `.gguf` file."""
    device: Device | str = Device.AUTO
    """"auto" takes CUDA when present, else CPU."""
    dtype: DType | str = DType.AUTO
    """"auto": float32 on CPU; on CUDA the checkpoint's 16-bit dtype, bfloat16 for float32 checkpoints."""
    tensor_parallel_size: int = 1
    """GPUs one model is split across (wave two; 1 for now)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the model's `max_position_embeddings`."""
    max_num_seqs: int = 256
    """Most requests in one step's batch."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step: prefill chunks and decodes share it."""
    block_size: int = 16
    """Tokens per KV-cache block (and per prefix-cache hash)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use in all (weights, activations, KV cache)."""
    num_kv_blocks: int | None = None
    """Explicit KV block count; None sizes it from memory (GPU) or `cpu_kv_cache_gib` (CPU)."""
    cpu_kv_cache_gib: float = 1.0
    """KV cache budget on CPU when `num_kv_blocks` is None."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes across requests."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (wave two)."""
    seed: int = 0
    """Seed for weight-free randomness: requests without their own seed draw from it."""
    attention_backend: AttentionBackendName | str = AttentionBackendName.AUTO
    """Which attention runs: "torch" (the pure-PyTorch reference), "triton" (paged Triton kernels), or "auto"
    (Triton on CUDA when installed, else torch)."""
    tokenizer: str | None = None
    """Tokenizer directory when it differs from `model`."""
    load_format: LoadFormat | str = LoadFormat.AUTO
    """"dummy" skips reading weights and fills them randomly: throughput benchmarks of real shapes."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or str(self.model) == "":
            raise _bad("model", self.model, "give a local checkpoint directory or .gguf file path")
        object.__setattr__(self, "model", str(self.model))
        object.__setattr__(self, "device", _enum(Device, "device", self.device))
        object.__setattr__(self, "dtype", _enum(DType, "dtype", self.dtype))
        object.__setattr__(
            self,
            "attention_backend",
            _enum(AttentionBackendName, "attention_backend", self.attention_backend),
        )
        object.__setattr__(self, "load_format", _enum(LoadFormat, "load_format", self.load_format))
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size != 1:
            raise _bad("tensor_parallel_size", self.tensor_parallel_size, "only 1 is supported in this version")
        _positive("max_model_len", self.max_model_len, optional=True)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise _bad("block_size", self.block_size, "use a power of two (e.g. 16)")
        if isinstance(self.gpu_memory_utilization, bool) or not (
            isinstance(self.gpu_memory_utilization, (int, float)) and 0.0 < self.gpu_memory_utilization <= 1.0
        ):
            raise _bad("gpu_memory_utilization", self.gpu_memory_utilization, "use a fraction in (0, 1]")
        _positive("num_kv_blocks", self.num_kv_blocks, optional=True)
        gib = self.cpu_kv_cache_gib
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < float("inf"):
            raise _bad("cpu_kv_cache_gib", self.cpu_kv_cache_gib, "use a positive number of GiB")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "use True or False")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise _bad("seed", self.seed, "use an integer")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, Path)) or str(self.tokenizer) == "":
                raise _bad("tokenizer", self.tokenizer, "give a tokenizer directory path, or None for `model`'s")
            object.__setattr__(self, "tokenizer", str(self.tokenizer))

    @classmethod
    def from_kwargs(cls, model: str, **engine_args: Any) -> EngineConfig:
        """Build from `AsyncLLMEngine(model, **engine_args)`; names the first unknown argument."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(
                f"unknown engine argument {unknown[0]!r}; known arguments: {', '.join(sorted(known - {'model'}))}"
            )
        return cls(model=model, **engine_args)
