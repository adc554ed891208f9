"""One engine's tensor-parallel process group: rendezvous, the collectives the sharded layers call, teardown.

No global state: each engine opens its own TCPStore on a loopback port the OS picks and builds its own
process-group object (never torch.distributed's default group), so two engines in one process or on one
host never meet. NCCL on CUDA, gloo on CPU; on CUDA, all-reduces up to a decode step's size may take the
custom path (`symm_all_reduce`), chosen by every rank together at set-up after a check against NCCL.
`ParallelContext` is the `layers.parallel.TPGroup` the model's layers call; it knows nothing of models or
steps. (Unlike the ring modules, this one imports torch.)
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch._C._distributed_c10d import AllreduceOptions, ProcessGroupGloo, ReduceOp, Store, TCPStore

from asyncllm.distributed.agree import choose_together

if TYPE_CHECKING:
    from asyncllm.distributed.symm_all_reduce import SymmMemAllReduce

logger = logging.getLogger(__name__)

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

    def __init__(
        self, store: Store, rank: int, world_size: int, device: torch.device, custom_all_reduce_bytes: int = 0
    ) -> None:
        """`custom_all_reduce_bytes`: the largest all-reduce (bytes) for the custom path, the same on every
        rank; 0 (or CPU, or one rank) keeps every collective on the backend."""
        self._store = store  # NCCL creates its communicators lazily through the store: keep it alive
        self._rank = rank
        self._world_size = world_size
        self.device = device
        self.backend_name = "nccl" if device.type == "cuda" else "gloo"
        self._aborted = False
        self._abort_lock = threading.Lock()
        self._pg: Any = _new_backend(store, rank, world_size, device)  # gloo or NCCL typed stubs differ
        self._custom: SymmMemAllReduce | None = None
        # Every rank runs this at once: NCCL then builds its communicator now, never inside a graph capture.
        self.all_reduce(torch.zeros(1, device=device))
        if device.type == "cuda" and world_size > 1 and custom_all_reduce_bytes > 0:
            self._custom = self._open_custom_all_reduce(custom_all_reduce_bytes)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @classmethod
    def join(
        cls, rendezvous: Rendezvous, rank: int, device: torch.device, custom_all_reduce_bytes: int = 0
    ) -> ParallelContext:
        """A worker's side: connect to rank 0's store, then build the group (blocks until every rank is in)."""
        timeout = timedelta(seconds=rendezvous.timeout_s)
        store = TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=False, timeout=timeout)
        return cls(store, rank, rendezvous.world_size, device, custom_all_reduce_bytes)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def custom_all_reduce(self) -> bool:
        """Whether small all-reduces take the custom path (every rank agrees; False after a failed set-up)."""
        return self._custom is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        custom = self._custom
        if custom is not None and custom.accepts(x):  # the same answer on every rank for the same call
            return custom.all_reduce_(x)
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
                custom, self._custom = self._custom, None
                if custom is not None:  # first: NCCL's abort may wait on kernels queued behind a waiting one
                    custom.abort()
                pg.abort()

    def close(self) -> None:
        """Release the group's communicators (an aborted group has released them). Idempotent."""
        with self._abort_lock:
            pg, self._pg = self._pg, None
            custom, self._custom = self._custom, None
        if custom is not None:
            custom.close()
        if pg is not None and self.backend_name == "nccl" and not self._aborted:
            pg.shutdown()

    def _open_custom_all_reduce(self, capacity: int) -> SymmMemAllReduce | None:
        """Set up the custom path on every rank at once, check it against NCCL, and agree: all ranks keep it or
        none does (`agree.choose_together`). A set-up failure leaves NCCL for everything, with one warning."""
        from asyncllm.distributed.symm_all_reduce import SymmMemAllReduce

        name = f"asyncllm-tp-{self._shared_token():012x}"  # the same on every rank, new for every engine

        def open_path() -> SymmMemAllReduce:
            return SymmMemAllReduce.open(
                self._pg, self._store, self._rank, self._world_size, self.device, capacity, name
            )

        custom, why = choose_together(
            open_path, self._agrees_with_backend, lambda ok: self.min_int(int(ok)) == 1, SymmMemAllReduce.close
        )
        if custom is None:
            logger.warning("rank %d: custom all-reduce off, NCCL does every all-reduce (%s)", self._rank, why)
        elif self._rank == 0:
            logger.info("custom all-reduce on: one-shot over symmetric memory, up to %d bytes", capacity)
        return custom

    def _agrees_with_backend(self, custom: SymmMemAllReduce) -> bool:
        """Random sums, different on every rank, through both paths: equal to NCCL's bit for bit (two ranks,
        the only size it is used at: a sum of two terms rounds the same in either order), and the same bits
        on every rank."""
        if self._world_size != 2:
            raise AssertionError(f"the custom all-reduce is checked at two ranks only, not {self._world_size}")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(0x5EED + self._rank)
        agrees = True
        for dtype in (torch.bfloat16, torch.float32):
            largest = custom.capacity // dtype.itemsize
            for numel in sorted({n for n in (8, 1032, largest) if n <= largest}):
                x = torch.randn(numel, generator=generator, device=self.device).to(dtype)  # [numel]
                got, want = x.clone(), x.clone()
                if not custom.accepts(got):
                    raise AssertionError(f"the custom path refuses its own check: {numel} x {dtype}")
                custom.all_reduce_(got)
                self._pg.allreduce([want]).wait()
                everyone = self.all_gather(got.view(1, numel))  # [world, numel]
                agrees = agrees and torch.equal(got, want) and bool((everyone == got).all())
        return agrees

    def _shared_token(self) -> int:
        """A random number of rank 0's, known to every rank (through the backend)."""
        t = torch.tensor([secrets.randbits(48) if self._rank == 0 else 0], dtype=torch.int64, device=self.device)
        self._pg.allreduce([t]).wait()
        return int(t.item())


def _new_backend(store: Store, rank: int, world_size: int, device: torch.device) -> Any:
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type != "cuda":
        return ProcessGroupGloo(store, rank, world_size, timeout)
    from torch._C._distributed_c10d import ProcessGroupNCCL  # absent from CPU builds of torch

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(store, rank, world_size, options)
