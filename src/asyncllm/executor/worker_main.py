"""A tensor-parallel worker process (ranks 1..N-1): the entry point `worker_procs` starts.

The process attaches to the ring, joins the engine's process group, builds its `Worker` as rank 0 does
(`build_worker`, in lock-step, from rank 0's resolved model and EOS ids; the checkpoint is reopened for its
weights alone, no config parsed and no tokenizer loaded until a constraint needs one) on its own device,
then runs every step the ring brings and discards the output (rank 0's is the engine's; every rank samples
the same tokens from the same gathered logits and seeds, and verifies the same drafts: a step verifying
drafts is read here, `verify_reads`, as the core reads it on rank 0). It reports "attached", "ready" or its
failure (with the traceback) on its report pipe, exits when the ring closes, and exits at once when the pipe
from its parent closes (the parent died). Knows nothing of scheduling.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from asyncllm.config import EngineConfig
from asyncllm.distributed.parallel_state import ParallelContext, Rendezvous
from asyncllm.distributed.shm_ring import RingClosedError, RingHandle
from asyncllm.executor.step_codec import AddLoRA, StepDecoder
from asyncllm.executor.verify_reads import VerifyReads
from asyncllm.step import SchedulerOutput
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.worker import Worker

# Status messages a worker sends its parent, in this order (FAILED instead, at any point).
ATTACHED, READY, FAILED = "attached", "ready", "failed"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs, picklable: the parent sends it down the worker's pipe."""

    config: EngineConfig
    resolved: ResolvedModel  # rank 0's device, dtype and architecture; this rank's device is `cuda_device`
    rank: int
    ring: RingHandle
    rendezvous: Rendezvous
    num_threads: int  # torch CPU threads: the host's cores shared among the ranks
    cuda_device: int | None  # the GPU this rank owns (rank 0's index + rank); None on CPU
    custom_all_reduce_bytes: int  # rank 0's choice (every rank must size the shared buffer alike); 0: NCCL only
    eos_token_ids: frozenset[int]  # rank 0's checkpoint's: the worker reopens only its weights (`reopen_checkpoint`)


def main() -> None:
    """The worker interpreter's entry: `python -c "...; main()" SPEC_FD REPORT_FD` (see worker_procs)."""
    # Ctrl-C in a terminal, and a service manager's SIGTERM (systemd signals the whole control group), reach
    # every process of the group: the engine's process decides when workers stop (it closes the ring, or
    # dies and closes our pipe), so that a server can drain its requests gracefully first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec_fd, report_fd = (int(arg) for arg in sys.argv[1:3])
    from_parent = Connection(spec_fd, writable=False)
    spec = from_parent.recv()
    assert isinstance(spec, WorkerSpec)
    _log_to_stderr(spec.rank)
    run_worker(spec, from_parent, Connection(report_fd, readable=False))


def run_worker(spec: WorkerSpec, parent_alive: Connection, status: Connection) -> None:
    """Run rank `spec.rank` until the ring closes; `parent_alive` closing ends the process at once."""
    _exit_with_parent(parent_alive)
    from asyncllm.distributed.shm_reader import ShmRingReader
    from asyncllm.model_loader.checkpoint import reopen_checkpoint
    from asyncllm.worker.setup import build_worker

    worker: Worker | None = None
    parallel: ParallelContext | None = None
    try:
        torch.set_num_threads(spec.num_threads)
        if spec.cuda_device is not None:
            torch.cuda.set_device(spec.cuda_device)  # before anything touches CUDA: this rank's GPU only
        resolved = spec.resolved
        if spec.cuda_device is not None:
            resolved = resolved.on(torch.device("cuda", spec.cuda_device))
        with ShmRingReader.attach(spec.ring) as reader:
            _send(status, ATTACHED)
            parallel = ParallelContext.join(spec.rendezvous, spec.rank, resolved.device, spec.custom_all_reduce_bytes)
            mc = spec.config.model_config
            checkpoint = reopen_checkpoint(mc.model, torch.float32, mc.tokenizer, spec.eos_token_ids)
            worker = build_worker(spec.config, checkpoint, resolved, parallel, parallel.min_int)
            _send(status, READY)
            decoder = StepDecoder()
            reads = VerifyReads()  # the steps verifying drafts, read as rank 0's core reads them
            while True:
                try:
                    data = reader.read()
                except RingClosedError:
                    break  # the engine shut down (or died): every step before was run
                message = decoder.decode_message(data)
                if isinstance(message, SchedulerOutput):
                    reads.before_submit(message)
                    reads.after_submit(message, worker.submit(message))
                elif isinstance(message, AddLoRA):
                    worker.add_lora(message.adapter)  # rank 0 loaded it first: the same file loads here
                else:
                    worker.remove_lora(message.lora_id)
    except BaseException:
        _send(status, FAILED, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if worker is not None:
            worker.shutdown()
        if parallel is not None:
            parallel.close()


def _log_to_stderr(rank: int) -> None:
    """This interpreter's warnings, each line naming its rank (the engine's process reports everything else,
    once: without a handler, Python would print them bare)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)-7s asyncllm rank {rank}: %(message)s", "%H:%M:%S")
    )
    logger = logging.getLogger("asyncllm")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)


def _send(status: Connection, kind: str, detail: str = "") -> None:
    with contextlib.suppress(OSError):  # the parent is gone; the watcher below ends this process
        status.send((kind, detail))


def _exit_with_parent(parent_alive: Connection) -> None:
    """A daemon thread that ends the process the moment the parent's end of the pipe closes: the parent
    exited or died, and no GPU process may outlive it (even one stuck in a collective)."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            parent_alive.recv_bytes()
        os._exit(0)

    threading.Thread(target=watch, name="asyncllm-parent-watch", daemon=True).start()
