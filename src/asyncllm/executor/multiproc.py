"""`MultiProcExecutor`: the `ModelExecutor` for tensor_parallel_size > 1 on one host.

Rank 0's `Worker` runs in the calling thread (the engine's step thread) and its output is the engine's;
ranks 1..N-1 run in spawned processes (`worker_main`). Each step is encoded as a delta (`step_codec`) and
broadcast through the shared-memory ring before rank 0 runs it; the forward pass's collectives keep the
ranks in lock-step. A dead worker fails the step in flight and every later one with `WorkerDiedError`, which
the step loop turns into `EngineDeadError` for every stream. Shutdown leaves no process, segment or group.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.distributed.parallel_state import ParallelContext, open_rendezvous
from asyncllm.distributed.shm_ring import RingTimeoutError
from asyncllm.distributed.shm_writer import ShmRingWriter
from asyncllm.distributed.symm_all_reduce import buffer_bytes
from asyncllm.errors import InvalidConfigError
from asyncllm.executor.step_codec import AddLoRA, RemoveLoRA, StepEncoder, encode_lora
from asyncllm.executor.worker_main import ATTACHED, READY, WorkerSpec
from asyncllm.executor.worker_procs import WorkerProcesses
from asyncllm.model_loader.base import Checkpoint
from asyncllm.models.tensor_parallel import check_tensor_parallel
from asyncllm.step import LoRAAdapter, ModelRunnerOutput, RuntimeInfo, SchedulerOutput, StepResult
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.setup import build_worker
from asyncllm.worker.threads import resolve_num_threads
from asyncllm.worker.worker import Worker

_START_TIMEOUT_S = 600.0  # spawn, import torch, load a shard, profile, capture graphs: all ranks at once
_RENDEZVOUS_TIMEOUT_S = 120.0  # joining the store and building the group, once every worker has attached
# A write blocked on a full ring re-checks the workers this often. Only a message of more slots than are free
# can block (rank 0 runs at most a step or two ahead): a live worker is then reading it as it is written, so a
# stall this long mid-message means a dead or stuck one (the ring is then abandoned and the engine fails).
_WRITE_POLL_S = 1.0
_JOIN_S = 10.0  # a clean shutdown waits this long for the workers to exit before killing them
# After a peer died, rank 0's release of its device (a device-wide sync) may wait for good on a kernel stuck
# on the dead peer (one no NCCL abort reaches): waited this long, then left to a daemon thread.
_DEAD_RELEASE_S = 3.0

logger = logging.getLogger(__name__)


def check_parallel_devices(device: torch.device, world_size: int) -> int | None:
    """The GPU index rank 0 owns (rank r owns the next r-th), or None on CPU, where any size runs (gloo)."""
    if device.type != "cuda":
        return None
    base = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if base + world_size > count:
        raise InvalidConfigError(
            f"tensor_parallel_size={world_size} needs {world_size} GPUs from cuda:{base}, and this host has "
            f"{count}: use tensor_parallel_size <= {count - base}"
        )
    return base


def custom_all_reduce_bytes(config: EngineConfig, hidden_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """The custom all-reduce's buffer: one decode step's hidden states, [max_num_seqs, hidden] in the model's
    dtype (larger messages, prefill chunks, go through NCCL); 0 turns it off (as ASYNCLLM_TP_CUSTOM_ALL_REDUCE=0
    does: read here once, for every rank)."""
    if not envs.TP_CUSTOM_ALL_REDUCE.get() or device.type != "cuda":
        return 0
    if config.parallel_config.tensor_parallel_size != 2:
        # Exact against NCCL at two ranks (two terms round the same in either order) and measured there;
        # beyond, the summation orders differ and it is neither checked bit for bit nor measured yet.
        logger.info("custom all-reduce off: used at tensor_parallel_size=2 only; NCCL does every all-reduce")
        return 0
    size = buffer_bytes(config.scheduler_config.max_num_seqs, hidden_size, dtype)
    if size == 0:
        logger.info("custom all-reduce off: the one-shot kernel does not sum %s; NCCL does every all-reduce", dtype)
    return size


class MultiProcExecutor:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        world = config.parallel_config.tensor_parallel_size
        resolved = ResolvedModel.resolve(config, checkpoint.hf_config)
        device = resolved.device
        check_tensor_parallel(resolved.arch, world)
        cuda_base = check_parallel_devices(device, world)
        all_reduce_bytes = custom_all_reduce_bytes(config, resolved.arch.hidden_size, resolved.dtype, device)
        self._closed = False
        self._started = True
        self._ring = ShmRingWriter(world - 1)
        self._procs: WorkerProcesses | None = None
        self._parallel: ParallelContext | None = None
        self._failure_callbacks: list[Callable[[BaseException], None]] = []  # watch_failure's, at most one
        self._worker: Worker | None = None
        self.grammar: GrammarBackend | None = None
        try:
            store, rendezvous = open_rendezvous(world, _RENDEZVOUS_TIMEOUT_S)
            chosen = config.device_config.num_threads
            threads = resolve_num_threads(chosen, device, world) or max(1, torch.get_num_threads() // world)
            specs = [
                WorkerSpec(
                    config,
                    resolved,
                    rank,
                    self._ring.reader_handle(rank - 1),
                    rendezvous,
                    threads,
                    None if cuda_base is None else cuda_base + rank,
                    all_reduce_bytes,
                    checkpoint.eos_token_ids,
                )
                for rank in range(1, world)
            ]
            self._procs = WorkerProcesses(specs)
            self._procs.wait_for(ATTACHED, _START_TIMEOUT_S)
            self._parallel = ParallelContext(store, 0, world, device, all_reduce_bytes)
            # Not a bound method of this executor: the monitor thread keeps `procs` alive, and through it the
            # executor would never be collected (a dropped LLM's finalizer would never stop its workers).
            self._procs.on_death = _death_handler(self._procs, self._parallel, self._failure_callbacks)
            self._worker = build_worker(config, checkpoint, resolved, self._parallel, self._parallel.min_int)
            self._runtime = self._worker.runtime
            self.grammar = self._worker.grammar  # rank 0's; each worker process compiles with its own
            self._procs.wait_for(READY, _START_TIMEOUT_S)
            # Dropped without shutdown() (an LLM never shut down), or at interpreter exit: still stop the
            # workers and remove the segment. Holds the ring and the processes, never the executor.
            self._finalizer = weakref.finalize(self, _stop_workers, self._ring, self._procs)
        except BaseException as exc:
            # Rank 0's own refusal of the configuration (a tensor-parallel cut inside a quantized group, say) is
            # the cause: the workers, checking the same thing, die of it too, and whether their deaths show
            # within the grace below is a race. Anything else may be a collective failed by a peer's death.
            own = isinstance(exc, InvalidConfigError)
            died = self._procs.failure() if self._procs is not None and not own else None
            self._started = False  # workers may wait in a set-up collective for ever: do not wait long
            self.shutdown()
            if died is not None:
                raise died from exc
            raise
        self._encoder = StepEncoder()

    @property
    def runtime(self) -> RuntimeInfo:
        return self._runtime

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids (ranks 1..N-1), for monitoring."""
        return self._procs.pids if self._procs is not None else []

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        self._failure_callbacks[:] = [callback]

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        procs, worker = self._procs, self._worker
        assert procs is not None and worker is not None, "submit after shutdown"
        procs.check()
        self._broadcast(self._encoder.encode(scheduled))  # the workers start on it while rank 0 does too
        try:
            result = worker.submit(scheduled)
        except Exception as exc:
            died = procs.failure()  # gloo fails a collective whose peer died: say which, and why
            if died is not None:
                raise died from exc
            raise
        return result if result.done() else _WatchedStep(result, procs)

    def add_lora(self, adapter: LoRAAdapter) -> None:
        """Rank 0 loads it first (a bad adapter raises here, before any worker sees it), then every worker
        does, before the next step."""
        procs, worker = self._procs, self._worker
        assert procs is not None and worker is not None, "add_lora after shutdown"
        procs.check()
        worker.add_lora(adapter)
        self._broadcast(encode_lora(AddLoRA(adapter)))

    def remove_lora(self, lora_id: int) -> None:
        assert self._worker is not None, "remove_lora after shutdown"
        self._worker.remove_lora(lora_id)
        self._broadcast(encode_lora(RemoveLoRA(lora_id)))

    def pending_graphs(self, capture_one: bool = False) -> int:
        """None is pending: every rank captures its graphs at start-up (a lazy capture would record one rank's
        collectives at a step the others replay)."""
        return 0

    def _broadcast(self, message: bytes) -> None:
        assert self._procs is not None
        while True:
            self._procs.check()
            try:
                self._ring.write(message, timeout=_WRITE_POLL_S)
                return
            except RingTimeoutError:
                continue  # the ring is full: the workers are behind, or dead (checked above)

    def shutdown(self) -> None:
        """Stop the workers (the ring closes: they finish what was sent and exit), release rank 0's device
        and the process group, and remove the ring's segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
        procs, parallel, worker = self._procs, self._parallel, self._worker
        healthy = self._started and procs is not None and procs.dead is None
        if procs is not None:
            procs.expect_exit()
        self._ring.close()
        if parallel is not None and not healthy:
            parallel.abort()  # before anything waits on the device: a collective may wait for the dead rank
        try:
            if worker is not None:
                if healthy:
                    worker.shutdown()
                else:
                    _bounded(worker.shutdown, _DEAD_RELEASE_S)
        finally:
            self._worker = None
            if parallel is not None:
                parallel.close()  # gloo: a worker left waiting in a collective with rank 0 fails at once
            if procs is not None:
                procs.stop(_JOIN_S if healthy else 1.0)


def _death_handler(
    procs: WorkerProcesses, parallel: ParallelContext, callbacks: list[Callable[[BaseException], None]]
) -> Callable[[], None]:
    """What the monitor thread runs when a worker exits unasked: unblock rank 0's collectives (NCCL: a dead
    peer's collective would never end), then tell the engine, which may be idle with no step to fail."""

    def on_death() -> None:
        parallel.abort()
        died = procs.failure(grace_s=0.0)
        if died is not None:
            for callback in list(callbacks):
                callback(died)

    return on_death


def _bounded(release: Callable[[], None], timeout_s: float) -> None:
    """Run `release` in a daemon thread for at most `timeout_s`; past that, leave it running (and say so)."""
    thread = threading.Thread(target=release, name="asyncllm-release", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning(
            "rank 0's device release still waits %.0f s after a tensor-parallel peer died (a kernel waits on the "
            "dead peer): left behind; the device stays held until this process exits",
            timeout_s,
        )


def _stop_workers(ring: ShmRingWriter, procs: WorkerProcesses) -> None:
    procs.expect_exit()
    ring.close()
    procs.stop(_JOIN_S)


class _WatchedStep:
    """Rank 0's step on a device that runs it asynchronously: waits for it while watching the workers, since
    a collective whose peer died never completes (NCCL) and its event would never fire."""

    def __init__(self, inner: StepResult, procs: WorkerProcesses) -> None:
        self._inner = inner
        self._procs = procs

    def done(self) -> bool:
        return self._inner.done()

    def start(self) -> None:
        self._inner.start()

    def result(self) -> ModelRunnerOutput:
        self._inner.start()  # a draw held back for its mask (no collective: launching it cannot hang)
        while not self._inner.done():
            self._procs.check()
            time.sleep(0)  # yield the GIL and the core, like CUDA's own yielding wait
        self._procs.check()  # the step ran, but a rank died meanwhile: its tokens may be garbage
        return self._inner.result()
