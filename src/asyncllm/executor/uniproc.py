"""`UniProcExecutor`: the `ModelExecutor` that runs one `Worker` in the calling thread.

Resolves the device, dtype and architecture once and builds the worker (`build_worker`, the same set-up
every executor runs; `build_pooling_worker` for an embed or score engine); the engine core drives it through
the `ModelExecutor` protocol.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncllm.config import EngineConfig
from asyncllm.model_loader.base import Checkpoint
from asyncllm.pooling import PoolerSpec
from asyncllm.step import LoRAAdapter, RuntimeInfo, SchedulerOutput, StepResult
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.pooling_setup import build_pooling_worker
from asyncllm.worker.setup import build_worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, pooler: PoolerSpec | None = None) -> None:
        resolved = ResolvedModel.resolve(config, checkpoint.hf_config, pooler)
        if pooler is None:
            self.worker = build_worker(config, checkpoint, resolved)
        else:  # an embed or score engine (worker/pooling_setup.py)
            self.worker = build_pooling_worker(config, checkpoint, resolved, pooler)
        self.grammar: GrammarBackend | None = self.worker.grammar  # shared with the front (build.py)

    @property
    def runtime(self) -> RuntimeInfo:
        return self.worker.runtime

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        return self.worker.submit(scheduled)

    def shutdown(self) -> None:
        self.worker.shutdown()

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        """In-process: nothing fails between steps."""

    def add_lora(self, adapter: LoRAAdapter) -> None:
        self.worker.add_lora(adapter)

    def remove_lora(self, lora_id: int) -> None:
        self.worker.remove_lora(lora_id)

    def pending_graphs(self, capture_one: bool = False) -> int:
        return self.worker.pending_graphs(capture_one)
