"""`WorkerKVTiers`: one rank's side of the KV tiers below the device (its host pool, `kv_host.py`, and its disk
directory, `kv_disk.py`): it runs each step's `KVTransfers` around the forward pass. `attach_kv_tiers` sets it
up from `kv_offloading_size` and `kv_cache_dir` (`kv_tier_setup.py`).

Per step, in the order the engine core planned (`core/kv_tiers.py`): first everything after joins the restores
the step before issued (their requests compute now); the copies to the host then wait for the compute stream
(the KV of every forward pass before, and their reads of blocks this step overwrites); then the offloads; the
disk reads start on loader threads (once the copies in flight into or out of their slots landed); the restores
go on their own stream, after the compute stream (and after the offloads, where the step has any). The forward
pass waits for the offloads (and, with `wait`, every copy to the host before), never for the step's restores or
reads. After it is launched, the `ahead` copies (beside it), then the disk writes of the slots filled, in the
background once their copies landed. Every step reports the disk reads finished since, the leading ones in
the order they were sent (a read counts as finished once it is on every rank, and as arrived only if it
succeeded on every rank: one all-reduce, in steps while reads are out). A step of no sequences waits a little
for the next few reads, so an engine waiting for them does not spin, and the core restores the blocks reported
(`BlockManager.take_transfers`) while the rest are read.
Copies never enter a CUDA graph: they run outside the replayed forward pass.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from concurrent.futures import Future, wait

import torch

from asyncllm.layers.parallel import TPGroup
from asyncllm.step import KVTransfers, ModelRunnerOutput, StepResult
from asyncllm.worker.kv_disk import DiskKVStore
from asyncllm.worker.kv_host import HostKVPool

_IDLE_WAIT_S = 0.005  # a step of no sequences waits this long at most for the next disk reads
_IDLE_WAIT_READS = 32  # ... for this many of them: their restores then overlap the reads after them


class WorkerKVTiers:
    def __init__(self, pool: HostKVPool, disk: DiskKVStore | None, parallel: TPGroup | None) -> None:
        self.pool = pool
        self.disk = disk
        self._parallel = parallel if parallel is not None and parallel.world_size > 1 else None
        self._reading: deque[Future[bool]] = deque()  # disk reads not reported yet, in the order sent

    @property
    def busy(self) -> bool:
        """Restores to join or disk reads to report: the next step must come through here, copies or not."""
        return self.pool.restoring or bool(self._reading)

    def before_forward(self, kv: KVTransfers, idle: bool = False) -> tuple[bool, ...] | None:
        """The copies that precede the step's forward pass; the disk reads finished since the last step, the
        leading ones in the order sent, each whether it arrived intact (None: none). `idle`: the step runs no
        model."""
        pool = self.pool
        pool.join_restores()
        pool.begin()
        if self.disk is not None:  # slots about to be overwritten: a write still reading one finishes first
            for slot in (*(s for _, s in kv.offloads), *(s for _, s, _ in kv.loads), *(s for _, s in kv.ahead)):
                self.disk.release(slot)
        pool.to_host(kv.offloads)
        if kv.loads:
            ready = pool.record()  # the copies into or out of the slots the reads fill landed
            if self.disk is not None:
                self._reading.extend(self.disk.load_async(kv.loads, ready))
            else:
                self._reading.extend(_done(False) for _ in kv.loads)
        pool.to_device(kv.restores, after_copies=kv.before_forward)
        if kv.before_forward:
            pool.join()
        return self._finished_reads(idle)

    def after_forward(self, kv: KVTransfers) -> None:
        """The `ahead` copies beside the forward pass just launched, then the disk writes of the step's slots."""
        self.pool.to_host(kv.ahead)
        if kv.writes and self.disk is not None:
            self.disk.write(kv.writes, self.pool.record())

    def close(self) -> None:
        """Finish the disk reads and writes, then release the host pool."""
        wait(self._reading)
        self._reading.clear()
        if self.disk is not None:
            self.disk.close()
        self.pool.close()

    def _finished_reads(self, idle: bool) -> tuple[bool, ...] | None:
        """The leading reads finished on every rank, popped: per read, whether it arrived intact everywhere."""
        if not self._reading:
            return None
        if idle:
            wait(list(itertools.islice(self._reading, _IDLE_WAIT_READS)), timeout=_IDLE_WAIT_S)
        if self._parallel is None:
            results = []
            for future in self._reading:
                if not future.done():
                    break
                results.append(future.result())
        else:
            # One all-reduce of two votes a read: finished here, and arrived here (0 while not finished).
            done = [f.done() for f in self._reading]
            votes = done + [d and f.result() for d, f in zip(done, self._reading, strict=True)]
            world = self._parallel.world_size
            summed = self._parallel.all_reduce(torch.tensor(votes, dtype=torch.float32, device=self.pool.device))
            flags = [v == world for v in summed.tolist()]
            everywhere, arrived = flags[: len(done)], flags[len(done) :]
            count = everywhere.index(False) if False in everywhere else len(done)
            results = arrived[:count]
        for _ in results:
            self._reading.popleft()
        return tuple(results) if results else None


def _done(value: bool) -> Future[bool]:
    future: Future[bool] = Future()
    future.set_result(value)
    return future


@dataclasses.dataclass(frozen=True)
class LoadedStep:
    """A step that reports disk reads finished (`ModelRunnerOutput.kv_loaded`)."""

    step: StepResult
    loaded: tuple[bool, ...]

    def done(self) -> bool:
        return self.step.done()

    def start(self) -> None:
        self.step.start()

    def result(self) -> ModelRunnerOutput:
        return dataclasses.replace(self.step.result(), kv_loaded=self.loaded)
