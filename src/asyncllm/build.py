"""The composition root: an `EngineConfig` in, a ready engine core out.

Opens the checkpoint, picks the executor (in-process, or tensor-parallel worker processes) which loads the
model and sizes the KV cache, and wires the core around it; it hands the front what input processing needs
(the runtime facts, the tokenizer and its encoders, and the in-process worker's check of output
constraints, so each constraint compiles once in this process) and builds none of it. The async layer's in-process
client calls `build_engine` inside its step thread (which then owns the device); `LLM` calls it directly.
This is the one place the torch-free layers meet the torch ones.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncllm.config import EngineConfig
from asyncllm.core.detokenizer import backend_tokenizer
from asyncllm.core.engine_core import EngineCore
from asyncllm.pooling import PoolerSpec, pooling_step_budget
from asyncllm.startup import Phases, log_banner
from asyncllm.step import RuntimeInfo
from asyncllm.structured import StructuredOutput

if TYPE_CHECKING:
    from asyncllm.executor.multiproc import MultiProcExecutor
    from asyncllm.executor.uniproc import UniProcExecutor

logger = logging.getLogger("asyncllm")


@dataclass
class BuiltEngine:
    core: EngineCore
    tokenizer: Any | None  # the Hugging Face tokenizer (chat template, encode), None if the checkpoint has none
    runtime: RuntimeInfo
    # Text to prompt ids, None without a tokenizer; `encode_batch` gives `encode`'s ids for many texts at once.
    encode: Callable[[str], list[int]] | None
    encode_batch: Callable[[list[str]], list[list[int]]] | None
    # Compiles a request's output constraint (cached), raising InvalidRequestError naming its field; None
    # when structured output is unavailable (no tokenizer, or no EOS id to end a complete output with).
    check_constraint: Callable[[StructuredOutput], None] | None = None


def build_engine(config: EngineConfig, clock: Callable[[], float]) -> BuiltEngine:
    """The engine core for `config`, with `runtime.startup_seconds` timing every phase of this build; logs
    what it loads as it starts and a banner of what it built (`asyncllm.startup`) at INFO."""
    phases = Phases()
    config = config.resolved(streaming=False)  # a no-op for the entry points' configs, which settled it
    mc = config.model_config
    logger.info("loading %s (device %s)", mc.model, config.device_config.device.value)
    with phases("import"):
        import torch

        from asyncllm.model_loader.checkpoint import open_checkpoint
        from asyncllm.model_loader.pooler_spec import engine_pooler
        from asyncllm.worker.device import resolve_device

    resolve_device(config.device_config.device)  # no such device: fail before reading anything
    with phases("open"):  # config, and a GGUF file's checks; a directory's tokenizer loads beside the worker
        # Host-side weights in float32 (lossless for 16-bit checkpoints); the worker casts as it copies them in.
        checkpoint = open_checkpoint(mc.model, torch.float32, mc.tokenizer, background_tokenizer=True)
        pooler = engine_pooler(config, checkpoint)  # the task: None generates (docs/embeddings.md)
    executor = make_executor(config, checkpoint, pooler)
    phases.add(executor.runtime.startup_seconds)  # the worker's steps: load, profile, kv_cache, warm_up, capture
    try:
        with phases("tokenizer"):  # what the tokenizer's load took beyond the worker's set-up (0 where it overlapped)
            tokenizer = checkpoint.loaded_tokenizer()
    except BaseException:  # a tokenizer that cannot load: the worker (its device memory, its ranks) goes too
        executor.shutdown()
        raise
    sched = config.scheduler_config
    budget = sched.max_num_batched_tokens
    if pooler is not None:  # an input runs whole in one step, and no prefix is shared (core/pooling.py)
        budget = pooling_step_budget(budget, executor.runtime.max_model_len)
    core = EngineCore(
        executor,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=budget,
        max_prefill_tokens_while_decoding=sched.max_prefill_tokens_while_decoding,
        enable_prefix_caching=config.cache_config.enable_prefix_caching and pooler is None,
        seed=mc.seed,
        tokenizer=backend_tokenizer(tokenizer) if tokenizer is not None else None,
        clock=clock,
        async_scheduling=sched.async_scheduling,
        max_cpu_loras=config.lora_config.max_cpu_loras,
        speculative=sched.speculative,
    )
    encode = encode_batch = None
    if tokenizer is not None:
        encode, encode_batch = Encode(tokenizer), EncodeBatch(tokenizer)

    check = executor.grammar.check if executor.grammar is not None else None
    runtime = dataclasses.replace(executor.runtime, startup_seconds=phases.record())
    log_banner(config, runtime)
    return BuiltEngine(core, tokenizer, runtime, encode, encode_batch, check)


class Encode:
    """Text to prompt ids with the checkpoint's tokenizer (a class: a core in another process pickles it
    to its front)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)


class EncodeBatch:
    """`Encode`'s ids for many texts in one call. The Rust batch call releases the GIL while it encodes (one
    call per text holds it): the event loops keep running while a burst of text prompts is tokenized. Same
    post-processor, so special tokens are added as the tokenizer's __call__ adds them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in backend_tokenizer(self.tokenizer).encode_batch(texts, add_special_tokens=True)]


def make_executor(
    config: EngineConfig, checkpoint: Any, pooler: PoolerSpec | None = None
) -> UniProcExecutor | MultiProcExecutor:
    """The executor for the parallel configuration: in-process for one rank, worker processes for more.
    `pooler`: an embed or score engine's (one rank only: `engine_pooler` refuses more)."""
    if config.parallel_config.tensor_parallel_size > 1:
        from asyncllm.executor.multiproc import MultiProcExecutor

        return MultiProcExecutor(config, checkpoint)
    from asyncllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config, checkpoint, pooler)
