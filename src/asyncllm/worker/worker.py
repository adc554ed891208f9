"""`Worker`: one device's model, KV cache and step runner, ready (`build_worker` made it); runs steps until
shut down. Every rank of a tensor-parallel group holds one and runs the same steps, in lock-step (the
collectives inside the forward pass).

Knows nothing of requests or scheduling; the executor drives it.
"""

from __future__ import annotations

import torch

from asyncllm.errors import LoRAError
from asyncllm.step import (
    KVTransfers,
    LoRAAdapter,
    ModelRunnerOutput,
    ReadyStep,
    RuntimeInfo,
    SchedulerOutput,
    StepResult,
)
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.worker.kv_tiers import LoadedStep, WorkerKVTiers
from asyncllm.worker.model_runner import ModelRunner
from asyncllm.worker.pooling_runner import PoolingRunner


class Worker:
    def __init__(self, runner: ModelRunner | PoolingRunner, runtime: RuntimeInfo) -> None:
        self.runner: ModelRunner | PoolingRunner | None = runner  # None once shut down (pooling: embed, score)
        self.runtime = runtime
        # Compiles output constraints over this model's vocabulary; the front of an in-process engine checks
        # requests with it, so each constraint compiles once in the process (None: no tokenizer or no EOS).
        self.grammar: GrammarBackend | None = runner.grammar
        self._device = runner.device
        self.kv_tiers: WorkerKVTiers | None = None  # the KV tiers below the device (`kv_tier_setup.py`)

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        assert self.runner is not None, "submit after shutdown"
        kv, tiers = scheduled.kv, self.kv_tiers
        if kv is None and (tiers is None or not tiers.busy):
            return self.runner.submit(scheduled)
        assert tiers is not None, "a step copies KV blocks to tiers this worker has not"
        kv = KVTransfers() if kv is None else kv  # the step before restored blocks, or disk reads are out
        loaded = tiers.before_forward(kv, idle=not scheduled.seqs)
        # A step of copies alone runs no model (the runner hears of finished requests with the next one).
        result = self.runner.submit(scheduled) if scheduled.seqs else ReadyStep(ModelRunnerOutput([]))
        tiers.after_forward(kv)
        return result if loaded is None else LoadedStep(result, loaded)

    def add_lora(self, adapter: LoRAAdapter) -> None:
        """Load an adapter between steps (`LoRAError` for one that cannot serve this model)."""
        assert self.runner is not None, "add_lora after shutdown"
        if self.runner.loras is None:
            raise LoRAError("this engine was built without enable_lora=True: it serves no adapters")
        self.runner.loras.add(adapter)

    def remove_lora(self, lora_id: int) -> None:
        if self.runner is not None and self.runner.loras is not None:
            self.runner.loras.remove(lora_id)

    def pending_graphs(self, capture_one: bool = False) -> int:
        """How many graphs lazy capture left for later are pending; `capture_one` (no step in flight): after
        capturing the next."""
        if self.runner is None or isinstance(self.runner, PoolingRunner):
            return 0
        return self.runner.graphs.capture_next() if capture_one else self.runner.graphs.pending

    def shutdown(self) -> None:
        """Release the device: graphs, KV cache and model (idempotent), after the disk tier's last writes."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
            self.kv_tiers = None
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
