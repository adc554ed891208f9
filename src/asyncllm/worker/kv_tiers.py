"""`WorkerKVTiers`: one rank's side of the KV tiers below the device (its host pool, `kv_host.py`, and its disk
directory, `kv_disk.py`): it runs each step's `KVTransfers` around the forward pass. `attach_kv_tiers` sets it
up from `kv_offloading_size` and `kv_cache_dir` (`kv_tier_setup.py`).

Per step, in the order the engine core planned (`core/kv_tiers.py`): the side stream first waits for the
compute stream (the KV of every forward pass before, and their reads of blocks this step overwrites); then the
offloads, the disk reads (the host waits for the copies in flight first: it writes the slots itself), the
restores; the forward pass waits for them all. After it is launched, the `ahead` copies (beside it), then the
disk writes of the slots filled, in the background once their copies landed. Every rank runs the same list on
its shard; a disk read counts only if it succeeded on every rank (one all-reduce, in steps that read).
Copies never enter a CUDA graph: they run outside the replayed forward pass.
"""

from __future__ import annotations

import dataclasses

import torch

from asyncllm.layers.parallel import TPGroup
from asyncllm.step import KVTransfers, ModelRunnerOutput, StepResult
from asyncllm.worker.kv_disk import DiskKVStore
from asyncllm.worker.kv_host import HostKVPool


class WorkerKVTiers:
    def __init__(self, pool: HostKVPool, disk: DiskKVStore | None, parallel: TPGroup | None) -> None:
        self.pool = pool
        self.disk = disk
        self._parallel = parallel if parallel is not None and parallel.world_size > 1 else None

    def before_forward(self, kv: KVTransfers) -> tuple[bool, ...] | None:
        """The copies that precede the step's forward pass; per disk read, whether it arrived on every rank
        (None: the step reads nothing)."""
        pool = self.pool
        pool.begin()
        if self.disk is not None:  # slots about to be overwritten: a write still reading one finishes first
            for slot in (*(s for _, s in kv.offloads), *(s for _, s, _ in kv.loads), *(s for _, s in kv.ahead)):
                self.disk.release(slot)
        pool.to_host(kv.offloads)
        loaded = self._load(kv.loads) if kv.loads else None
        pool.to_device(kv.restores)
        if kv.before_forward:
            pool.join()
        return loaded

    def after_forward(self, kv: KVTransfers) -> None:
        """The `ahead` copies beside the forward pass just launched, then the disk writes of the step's slots."""
        self.pool.to_host(kv.ahead)
        if kv.writes and self.disk is not None:
            self.disk.write(kv.writes, self.pool.record())

    def close(self) -> None:
        """Finish the disk writes, then release the host pool."""
        if self.disk is not None:
            self.disk.close()
        self.pool.close()

    def _load(self, loads: list[tuple[int, int, bytes]]) -> tuple[bool, ...]:
        self.pool.synchronize()  # the host writes these slots: no copy may still read or fill them
        ok = self.disk.load(loads) if self.disk is not None else [False] * len(loads)
        if self._parallel is not None:
            votes = torch.tensor(ok, dtype=torch.float32, device=self.pool.device)
            ok = [v == self._parallel.world_size for v in self._parallel.all_reduce(votes).tolist()]
        return tuple(ok)


@dataclasses.dataclass(frozen=True)
class LoadedStep:
    """A step that read blocks from disk: its output says which arrived (`ModelRunnerOutput.kv_loaded`)."""

    step: StepResult
    loaded: tuple[bool, ...]

    def done(self) -> bool:
        return self.step.done()

    def start(self) -> None:
        self.step.start()

    def result(self) -> ModelRunnerOutput:
        return dataclasses.replace(self.step.result(), kv_loaded=self.loaded)
