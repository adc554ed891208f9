"""Engine configuration: small frozen parts (model, cache, scheduler, parallel, device, LoRA), composed.

Users pass flat keyword arguments (`AsyncLLMEngine(model, block_size=32)`); `EngineConfig.from_kwargs`
routes each to the part that owns it, and every part validates its fields at construction with an
`InvalidConfigError` naming the field, the value and the fix. Only what the user chose lives here: facts
learned at run time (the model's shape, KV blocks after profiling, EOS ids) live in `RuntimeInfo`.
Plain Python; no torch. The value sets of named arguments are in `config_values.py`, the device part in
`config_device.py`, the fields' shared pieces in `config_fields.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncllm import envs
from asyncllm.config_device import DeviceConfig
from asyncllm.config_fields import arg, from_env, invalid, local_path, set_field, writable_dir
from asyncllm.config_speculative import SpeculativeConfig
from asyncllm.config_values import (
    KV_CACHE_DTYPES_REFUSED,
    DType,
    KVCacheDType,
    LoadFormat,
    Quantization,
    Task,
)
from asyncllm.errors import InvalidConfigError, UnknownArgumentError
from asyncllm.validation import check_bool, check_enum, check_float, check_int, check_optional_int

# Entry-point defaults: the prompt tokens a streaming step may carry beside its decodes (`EngineConfig.resolved`),
# and the largest step carrying prompts that replays a graph (`EngineConfig.graph_max_tokens`: a capped step
# fits it).
STREAMING_PREFILL_CAP = 2048  # W2's p99 token gap 1.9x the median, 5.9x uncapped (bench/RESULTS.md, run 28)
DEFAULT_GRAPH_TOKENS = 2048


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What to load and at which precision and length."""

    model: str = field(
        metadata={"doc": "Local checkpoint directory (config.json, *.safetensors, tokenizer) or a `.gguf` file."}
    )
    tokenizer: str | None = arg(None, "Tokenizer directory when it differs from `model`.")
    dtype: DType = arg(
        DType.AUTO, '"auto": float32 on CPU; on CUDA the checkpoint\'s 16-bit dtype, bfloat16 for float32 checkpoints.'
    )
    max_model_len: int | None = arg(
        None, "Longest prompt + output in tokens; None takes the model's `max_position_embeddings`."
    )
    load_format: LoadFormat = arg(
        LoadFormat.AUTO, '"dummy" skips reading weights and fills them randomly: throughput benchmarks of real shapes.'
    )
    seed: int = arg(0, "Seed for weight-free randomness: requests without their own seed draw from it.")
    quantization: Quantization | None = arg(
        None,
        "None: as the checkpoint says (its config.json `quantization_config`: AWQ, GPTQ, FP8; a GGUF file's "
        "Q8_0/Q4_0/Q4_1 linear layers stay quantized on CUDA, dequantized on CPU), else unquantized. "
        '"fp8" quantizes a 16-bit (or GGUF) checkpoint\'s linear weights to e4m3 at load (one scale per output '
        'channel); "awq" / "gptq" / "fp8" / "gguf" given for a quantized checkpoint must match it '
        "(docs/quantization.md).",
    )
    task: Task | None = arg(
        None,
        '"generate" (text), "embed" (embed: vectors) or "score" (score/rerank: relevance of documents to a query). '
        "None: what the checkpoint says (sentence-transformers files or an encoder: embed; a "
        "*ForSequenceClassification: score; else generate). docs/embeddings.md.",
    )

    def __post_init__(self) -> None:
        set_field(self, "model", local_path("model", self.model, optional=False))
        if self.task is not None:
            set_field(self, "task", check_enum(invalid, Task, "task", self.task))
        set_field(self, "tokenizer", local_path("tokenizer", self.tokenizer, optional=True))
        set_field(self, "dtype", check_enum(invalid, DType, "dtype", self.dtype))
        check_optional_int(invalid, "max_model_len", self.max_model_len, "an integer >= 1, or None", lo=1)
        set_field(self, "load_format", check_enum(invalid, LoadFormat, "load_format", self.load_format))
        check_int(invalid, "seed", self.seed, "an integer")
        if self.quantization is not None:
            set_field(self, "quantization", check_enum(invalid, Quantization, "quantization", self.quantization))


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The paged KV cache: block size, how much memory it takes, prefix caching."""

    block_size: int = arg(16, "Tokens per KV-cache block (and per prefix-cache hash); a power of two.")
    gpu_memory_utilization: float = arg(
        0.9, "Fraction of GPU memory the engine may use in all (weights, activations, CUDA graphs, KV cache)."
    )
    num_kv_blocks: int | None = arg(
        None, "Explicit KV block count; None sizes it from memory (GPU) or `cpu_kv_cache_gib` (CPU)."
    )
    cpu_kv_cache_gib: float | None = from_env(envs.CPU_KVCACHE_SPACE)  # not an argument: ASYNCLLM_CPU_KVCACHE_SPACE
    enable_prefix_caching: bool = arg(True, "Reuse KV blocks of identical prefixes across requests.")
    kv_cache_dtype: KVCacheDType = arg(
        KVCacheDType.AUTO,
        '"auto": the model\'s dtype. "fp8" (or "fp8_e4m3"): e4m3 codes, one byte per element, so the same memory '
        "holds twice the blocks of a 16-bit cache and decode reads half the bytes; keys and values are divided by "
        "a per-layer scale (the checkpoint's k_scale / v_scale, else 1.0) and saturated to +-448. "
        "docs/quantization.md.",
    )
    kv_offloading_size: float = arg(
        0.0,
        "GiB of host memory for KV blocks the prefix cache evicts from the device; a later hit copies them back "
        "instead of recomputing (docs/API.md, KV cache beyond the GPU). 0: off.",
    )
    kv_cache_dir: str | None = arg(
        None,
        "A directory where evicted KV blocks are also kept on disk, found again by a later engine on the same "
        "model and settings (after a restart). Created if missing; None: off.",
    )

    def __post_init__(self) -> None:
        check_int(invalid, "block_size", self.block_size, "an integer >= 1", lo=1)
        if self.block_size & (self.block_size - 1):
            raise invalid("block_size", self.block_size, "a power of two (e.g. 16)")
        fraction = "a fraction in (0, 1]"
        set_field(
            self,
            "gpu_memory_utilization",
            check_float(
                invalid, "gpu_memory_utilization", self.gpu_memory_utilization, fraction, lo=0.0, hi=1.0, lo_open=True
            ),
        )
        check_optional_int(invalid, "num_kv_blocks", self.num_kv_blocks, "an integer >= 1, or None", lo=1)
        gib = "a positive number of GiB, or None"
        if self.cpu_kv_cache_gib is not None:
            set_field(
                self,
                "cpu_kv_cache_gib",
                check_float(invalid, "cpu_kv_cache_gib", self.cpu_kv_cache_gib, gib, lo=0.0, lo_open=True),
            )
        check_bool(invalid, "enable_prefix_caching", self.enable_prefix_caching)
        size = check_float(invalid, "kv_offloading_size", self.kv_offloading_size, "a number of GiB >= 0", lo=0.0)
        set_field(self, "kv_offloading_size", size)
        set_field(self, "kv_cache_dir", writable_dir("kv_cache_dir", self.kv_cache_dir))
        if (size > 0 or self.kv_cache_dir is not None) and not self.enable_prefix_caching:
            tier = f"kv_offloading_size={size}" if size > 0 else f"kv_cache_dir={self.kv_cache_dir!r}"
            raise InvalidConfigError(
                f"{tier} keeps the prefix cache's evicted blocks: it needs enable_prefix_caching=True (or turn "
                "the tiers off: kv_offloading_size=0, kv_cache_dir=None)"
            )
        refused = KV_CACHE_DTYPES_REFUSED.get(self.kv_cache_dtype) if isinstance(self.kv_cache_dtype, str) else None
        if refused is not None:
            raise InvalidConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: {refused}")
        set_field(self, "kv_cache_dtype", check_enum(invalid, KVCacheDType, "kv_cache_dtype", self.kv_cache_dtype))


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How many requests and tokens one step may hold."""

    max_num_seqs: int = arg(256, "Most requests in one step's batch.")
    max_num_batched_tokens: int = arg(8192, "Token budget of one step: prefill chunks and decodes share it.")
    max_prefill_tokens_while_decoding: int | None = arg(
        None,
        "Prompt tokens one step may carry while requests also decode in it; a long step delays every stream's "
        "next token. None: the entry point's default, 2048 for AsyncLLMEngine and the server (even gaps "
        "between tokens while prompts arrive; README: On a GPU), the whole step budget for LLM (offline "
        "throughput). A value >= max_num_batched_tokens turns the cap off.",
    )
    async_scheduling: bool = from_env(envs.ASYNC_SCHEDULING)  # not an argument: ASYNCLLM_ASYNC_SCHEDULING
    max_waiting_requests: int | None = arg(
        None,
        "Most requests accepted that have not started computing (being tokenized, on their way to the core, "
        "or waiting for a seat or memory; a preempted request does not count again). Beyond it add_request "
        "raises EngineOverloadedError at once (the server answers 429). None: unbounded. AsyncLLMEngine only.",
    )
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = arg(
        None,
        'Speculative decoding, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}, {"method": "suffix"}, {"method": "draft_model", '
        '"model": "path/to/draft", "num_speculative_tokens": 4} or {"method": "eagle3", "model": "path/to/head", '
        '"num_speculative_tokens": 3} (JSON on the command line); the same tokens as '
        "without it (docs/API.md, Speculative decoding). None: off.",
    )

    def __post_init__(self) -> None:
        check_int(invalid, "max_num_seqs", self.max_num_seqs, "an integer >= 1", lo=1)
        check_int(invalid, "max_num_batched_tokens", self.max_num_batched_tokens, "an integer >= 1", lo=1)
        check_optional_int(
            invalid,
            "max_prefill_tokens_while_decoding",
            self.max_prefill_tokens_while_decoding,
            "an integer >= 1, or None",
            lo=1,
        )
        check_bool(invalid, "async_scheduling", self.async_scheduling)
        check_optional_int(invalid, "max_waiting_requests", self.max_waiting_requests, "an integer >= 1, or None", lo=1)
        set_field(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config`, as normalised at construction."""
        assert self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig)
        return self.speculative_config


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is split across devices."""

    tensor_parallel_size: int = arg(
        1,
        "Ranks one model is split across on this host (worker processes; one GPU each on CUDA, gloo on CPU). "
        "Must divide the model's attention heads; checked against the model and the GPUs when the engine starts.",
    )

    def __post_init__(self) -> None:
        check_int(invalid, "tensor_parallel_size", self.tensor_parallel_size, "an integer >= 1", lo=1)


# A LoRA rank padded for the kernels stays within a Triton tile; vLLM's largest supported rank is the same.
MAX_LORA_RANK = 512


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (docs/lora.md)."""

    enable_lora: bool = arg(
        False,
        "Serve LoRA adapters (add_lora, then add_request(..., lora=name)). Off: no adapter memory, no cost per step.",
    )
    max_loras: int = arg(
        4,
        "Adapters one batch may mix: the adapter slots kept on the device. An adapter takes a slot while a "
        "running request uses it; a waiting request whose adapter finds none waits (in its turn) for one to "
        "free. Idle adapters stay in their slot until another needs it (least recently used first).",
    )
    max_lora_rank: int = arg(16, "The largest adapter rank accepted; every slot holds this rank (zero-padded).")
    max_cpu_loras: int | None = arg(
        None,
        "Most adapters added at once (kept in host memory; those in slots too): add_lora beyond it raises "
        "LoRAError. None: no limit.",
    )

    def __post_init__(self) -> None:
        check_bool(invalid, "enable_lora", self.enable_lora)
        check_int(invalid, "max_loras", self.max_loras, "an integer >= 1", lo=1)
        check_int(invalid, "max_lora_rank", self.max_lora_rank, f"an integer in [1, {MAX_LORA_RANK}]", lo=1)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise invalid("max_lora_rank", self.max_lora_rank, f"an integer in [1, {MAX_LORA_RANK}]")
        check_optional_int(invalid, "max_cpu_loras", self.max_cpu_loras, "an integer >= 1, or None", lo=1)


# Former engine arguments that are ASYNCLLM_* variables now (docs/tuning.md): their old names get a pointer.
_MOVED_TO_ENV = {var.name.removeprefix("ASYNCLLM_").lower(): var.name for var in envs.ALL} | {
    "cpu_kv_cache_gib": envs.CPU_KVCACHE_SPACE.name
}

_PARTS: dict[str, type] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "device_config": DeviceConfig,
    "lora_config": LoRAConfig,
}


@dataclass(frozen=True)
class EngineArgument:
    """One engine keyword argument: for documentation and command-line flags."""

    name: str
    default: object
    doc: str
    part: str  # which EngineConfig field owns it


@dataclass(frozen=True)
class EngineConfig:
    """Every engine argument of the public API, validated, in six parts.

    Build it with `EngineConfig.from_kwargs(model, **engine_args)`; an unknown name raises
    `UnknownArgumentError` (a `TypeError`) naming it.
    """

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, model: str | Path, **engine_args: Any) -> EngineConfig:
        """Build from `AsyncLLMEngine(model, **engine_args)`; names the first unknown argument."""
        owners = {arg.name: arg.part for arg in engine_arguments()}
        unknown = sorted(set(engine_args) - set(owners))
        if unknown:
            variable = _MOVED_TO_ENV.get(unknown[0])
            if variable is not None:
                raise UnknownArgumentError(
                    f"unknown engine argument {unknown[0]!r}: it is the environment variable {variable} now "
                    "(docs/tuning.md)"
                )
            known = ", ".join(sorted(set(owners) - {"model"}))
            raise UnknownArgumentError(f"unknown engine argument {unknown[0]!r}; known arguments: {known}")
        grouped: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        grouped["model_config"]["model"] = model
        for name, value in engine_args.items():
            grouped[owners[name]][name] = value
        return cls(**{part: _PARTS[part](**kwargs) for part, kwargs in grouped.items()})

    def resolved(self, *, streaming: bool) -> EngineConfig:
        """This config with the defaults that depend on the entry point settled (idempotent: only None
        fields change). Streaming (`AsyncLLMEngine`, the server) caps the prompt tokens of steps that also
        decode, for even gaps between tokens; offline (`LLM`) gives prompts the whole step budget."""
        sched = self.scheduler_config
        cap = sched.max_prefill_tokens_while_decoding
        if cap is None:
            cap = STREAMING_PREFILL_CAP if streaming else sched.max_num_batched_tokens
        return dataclasses.replace(
            self, scheduler_config=dataclasses.replace(sched, max_prefill_tokens_while_decoding=cap)
        )

    def graph_max_tokens(self, chosen: int | None) -> int:
        """The largest step carrying prompts that replays a CUDA graph: `chosen`
        (ASYNCLLM_CUDA_GRAPH_MAX_TOKENS), else 2048, or every decode plus the prefill cap when that is larger,
        so that capped steps replay graphs (an unsettled cap is the offline one: the whole step budget)."""
        if chosen is not None:
            return chosen
        sched = self.scheduler_config
        budget = sched.max_num_batched_tokens
        cap = sched.max_prefill_tokens_while_decoding or budget
        return max(DEFAULT_GRAPH_TOKENS, sched.max_num_seqs + cap) if cap < budget else DEFAULT_GRAPH_TOKENS

    @property
    def model(self) -> str:
        return self.model_config.model


def engine_arguments() -> list[EngineArgument]:
    """Every engine keyword argument (and `model`) with its default and documentation, in declaration order."""
    args = []
    for part, cls in _PARTS.items():
        for f in dataclasses.fields(cls):
            if "env" in f.metadata:
                continue  # an ASYNCLLM_* variable's, not the user's (config_fields.from_env)
            default = None if f.default is dataclasses.MISSING else f.default
            args.append(EngineArgument(f.name, getattr(default, "value", default), f.metadata.get("doc", ""), part))
    return args
