"""Building a whole engine from an `EngineConfig`: checkpoint, runner, core, input processor.

The async layer calls `build_engine` inside its step thread (which then owns the device); `LLM` calls it
directly. This is where the torch-free layers meet the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncllm.config import EngineConfig
from asyncllm.core.detokenizer import backend_tokenizer
from asyncllm.core.engine_core import EngineCore
from asyncllm.core.input_processor import InputProcessor
from asyncllm.core.runtime import RuntimeInfo


@dataclass
class BuiltEngine:
    core: EngineCore
    input_processor: InputProcessor
    tokenizer: Any | None  # the Hugging Face tokenizer (chat template, encode), None if the checkpoint has none
    runtime: RuntimeInfo


def build_engine(config: EngineConfig, clock: Callable[[], float]) -> BuiltEngine:
    import torch

    from asyncllm.runner.checkpoint import open_checkpoint
    from asyncllm.runner.model_runner import ModelRunner

    # Host-side weights in float32 (lossless for 16-bit checkpoints); the runner casts as it copies them in.
    checkpoint = open_checkpoint(config.model, torch.float32, config.tokenizer)
    runner = ModelRunner(config, checkpoint)
    tokenizer = checkpoint.tokenizer
    rust_tokenizer = backend_tokenizer(tokenizer) if tokenizer is not None else None
    core = EngineCore(
        runner,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        tokenizer=rust_tokenizer,
        clock=clock,
    )
    encode = None if tokenizer is None else (lambda text: list(tokenizer(text).input_ids))
    return BuiltEngine(core, InputProcessor(runner.runtime, encode), tokenizer, runner.runtime)
