"""`UniProcExecutor`: the `ModelExecutor` that runs one `Worker` in the calling thread.

Owns the worker's set-up order (load, size the cache, allocate); the engine core drives it through the
`ModelExecutor` protocol. A tensor-parallel executor will drive several workers the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncllm.config import EngineConfig
from asyncllm.model_loader.base import Checkpoint
from asyncllm.step import RuntimeInfo, SchedulerOutput, StepResult
from asyncllm.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        worker = self.worker = Worker(config, checkpoint)
        worker.load_model()
        worker.init_kv_cache(worker.determine_num_blocks())
        worker.warm_up()
        worker.capture_cuda_graphs()
        self._runtime = worker.runtime_info()

    @property
    def runtime(self) -> RuntimeInfo:
        return self._runtime

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        return self.worker.submit(scheduled)

    def shutdown(self) -> None:
        self.worker.shutdown()

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        """In-process: nothing fails between steps."""
