"""One engine's tensor-parallel process group: rendezvous, the collectives the sharded layers call, teardown.

No global state: each engine opens its own TCPStore on a loopback port the OS picks and builds its own
process-group object (never torch.distributed's default group), so two engines in one process or on one
host never meet. NCCL on CUDA, gloo on CPU. `ParallelContext` is the `layers.parallel.TPGroup` the model's
layers call; it knows nothing of models or steps. (Unlike the ring modules, this one imports torch.)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import AllreduceOptions, ProcessGroupGloo, ReduceOp, Store, TCPStore

_LOOPBACK = "127.0.0.1"
COLLECTIVE_TIMEOUT_S = 600.0  # a collective waiting this long fails (a live but stuck peer); no step takes that


@dataclass(frozen=True)
class Rendezvous:
    """Where one engine's ranks meet: picklable, handed to each spawned worker."""

    port: int
    world_size: int
    timeout_s: float  # for joining the store and building the group
    host: str = _LOOPBACK


def open_rendezvous(world_size: int, timeout_s: float) -> tuple[TCPStore, Rendezvous]:
    """Rank 0's side: a store listening on a free port (0: the OS picks one, so engines never collide)."""
    store = TCPStore(
        _LOOPBACK, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return store, Rendezvous(store.port, world_size, timeout_s)


class ParallelContext:
    """This rank's view of the group: rank, world size, and the collectives (each blocks the host on gloo;
    on NCCL each is ordered on the current stream, so CUDA graphs capture them)."""

    def __init__(self, store: Store, rank: int, world_size: int, device: torch.device) -> None:
        self._store = store  # NCCL creates its communicators lazily through the store: keep it alive
        self._rank = rank
        self._world_size = world_size
        self.device = device
        self.backend_name = "nccl" if device.type == "cuda" else "gloo"
        self._aborted = False
        self._abort_lock = threading.Lock()
        self._pg: Any = _new_backend(store, rank, world_size, device)  # gloo or NCCL typed stubs differ
        # Every rank runs this at once: NCCL then builds its communicator now, never inside a graph capture.
        self.all_reduce(torch.zeros(1, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @classmethod
    def join(cls, rendezvous: Rendezvous, rank: int, device: torch.device) -> ParallelContext:
        """A worker's side: connect to rank 0's store, then build the group (blocks until every rank is in)."""
        timeout = timedelta(seconds=rendezvous.timeout_s)
        store = TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=False, timeout=timeout)
        return cls(store, rank, rendezvous.world_size, device)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty((self._world_size * x.shape[0], *x.shape[1:]))  # [world * N, ...]
        self._pg._allgather_base(out, x).wait()
        return out

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks: every rank must allocate the same count)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = AllreduceOptions()
        options.reduceOp = ReduceOp(ReduceOp.MIN)
        self._pg.allreduce([t], options).wait()
        return int(t.item())

    def abort(self) -> None:
        """Unblock this rank's collectives after a peer died. NCCL only: gloo already fails such collectives
        (the peer's socket closes), while an NCCL kernel would wait on the GPU for ever. Idempotent."""
        with self._abort_lock:  # the engine's monitor thread and its step thread may both get here
            pg = self._pg
            if pg is not None and self.backend_name == "nccl" and not self._aborted:
                self._aborted = True
                pg.abort()

    def close(self) -> None:
        """Release the group's communicators (an aborted group has released them). Idempotent."""
        with self._abort_lock:
            pg, self._pg = self._pg, None
        if pg is not None and self.backend_name == "nccl" and not self._aborted:
            pg.shutdown()


def _new_backend(store: Store, rank: int, world_size: int, device: torch.device) -> Any:
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type != "cuda":
        return ProcessGroupGloo(store, rank, world_size, timeout)
    from torch._C._distributed_c10d import ProcessGroupNCCL  # absent from CPU builds of torch

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(store, rank, world_size, options)
