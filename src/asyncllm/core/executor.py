"""The interface the engine core drives the model through. Implemented by the runner layer (torch);
the core only sees plain data in and out, so a tensor-parallel or remote executor fits behind it."""

from __future__ import annotations

from typing import Protocol

from asyncllm.core.runtime import RuntimeInfo
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ModelExecutor(Protocol):
    @property
    def runtime(self) -> RuntimeInfo: ...

    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: write KV for every scheduled token, sample where `sample` is set."""
        ...

    def shutdown(self) -> None:
        """Release device memory. Idempotent."""
        ...
