"""The custom all-reduce for small messages: torch's one-shot kernel over a symmetric-memory buffer.

Each rank copies its message into its own slice of a buffer every rank can read over NVLink; one kernel then
waits for the peers (flags in the buffer's signal pad), sums every rank's copy in rank order and writes the sum
into the message in place. That is two launches and no NCCL proxy, and every rank ends with the same bits.
torch (torch/csrc/distributed/c10d/symm_mem) finds the group by name in its process-group registry (store, rank,
size); our NCCL backend is a bare object, so `SymmMemAllReduce.open` wraps it in a `ProcessGroup` registered
under a name unique to the engine. Owns the buffer, that registration and the drain after a peer dies; the
choice between this and NCCL, and the check against NCCL, are `parallel_state`'s. CUDA only: the pieces CPU
builds of torch lack are imported inside functions.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch

from asyncllm.distributed.aligned_store import SequenceAlignedStore

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName  # a typing alias of str (torch >= 2.10)

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)  # what symm_mem::one_shot_all_reduce dispatches on
_ALIGN = 16  # bytes: the kernel's widest vector access; message sizes and addresses must be multiples of it
_MAX_BLOCKS = 24  # one_shot_all_reduce's most thread blocks (CUDASymmetricMemoryOps.cu): its signal slots
_STORE_WAIT = timedelta(seconds=30)  # a rendezvous exchange waiting this long fails set-up (NCCL is kept)
_DRAIN_S = 10.0  # after a peer died: how long the signal flags are forced so queued kernels can finish

# torch numbers its rendezvous store keys with one counter per process: two engines setting up at once in
# threads of one process would interleave it. Held only for the rendezvous.
_RENDEZVOUS_LOCK = threading.Lock()


def buffer_bytes(rows: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of the symmetric buffer for all-reduces up to [rows, hidden_size] of `dtype`; 0 when the kernel
    cannot sum that dtype (NCCL then does everything)."""
    if dtype not in SUPPORTED_DTYPES:
        return 0
    return -(-rows * hidden_size * dtype.itemsize // _ALIGN) * _ALIGN


class SymmMemAllReduce:
    def __init__(self, name: str, buffer: torch.Tensor, kept: list[object], drain: _Drain) -> None:
        self.name = name  # the registered group name the kernel looks the buffer up by
        self.capacity = buffer.numel()  # bytes
        self._buffer: torch.Tensor | None = buffer  # [capacity] uint8, symmetric
        self._kept = kept  # rendezvous handle, registered group, its store: alive until close
        self._drain: _Drain | None = drain
        self._closed = False

    @classmethod
    def open(
        cls, backend: Any, store: Any, rank: int, world_size: int, device: torch.device, capacity: int, name: str
    ) -> SymmMemAllReduce:
        """Register the group as `name`, allocate `capacity` bytes of symmetric memory and rendezvous (store
        exchanges and file-descriptor passing: every rank calls this at once). Raises on any failure."""
        from torch._C._distributed_c10d import PrefixStore, _SymmetricMemory

        if not torch._C._dispatch_has_kernel_for_dispatch_key("symm_mem::one_shot_all_reduce_out", "CUDA"):
            raise RuntimeError("this torch build has no CUDA kernel for symm_mem::one_shot_all_reduce_out")
        if capacity <= 0 or capacity % _ALIGN:
            raise ValueError(f"capacity={capacity} must be a positive multiple of {_ALIGN} bytes")
        get_backend = getattr(_SymmetricMemory, "get_backend", None)
        chosen = get_backend(device) if get_backend is not None else None
        if chosen not in (None, "CUDA"):
            raise RuntimeError(f"symmetric memory backend {chosen!r} (TORCH_SYMMMEM): only 'CUDA' is used here")
        aligned = SequenceAlignedStore(PrefixStore(f"{name}/", store), _STORE_WAIT)
        group = register_group(name, backend, aligned, rank, world_size, "cuda")
        try:
            with _RENDEZVOUS_LOCK:
                # Its own allocation, not symm_mem.empty's pool: freed, it releases the peers' mappings too.
                buffer = _SymmetricMemory.empty_strided_p2p((capacity,), (1,), torch.uint8, device, name)
                handle = _rendezvous(buffer, name, rank, world_size, aligned)
            drain = _Drain(handle, rank, world_size, device)
        except BaseException:
            unregister_group(name)
            raise
        torch.cuda.synchronize(device)
        return cls(name, buffer, [handle, group, aligned], drain)

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through this path: by its shape, dtype, layout and 16-byte address alignment. All
        ranks must take the same path for the same call, or the kernel would wait for ever; they do because
        every caller passes tensors alike in all four on every rank (`TPGroup.all_reduce` requires it)."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in SUPPORTED_DTYPES
            and x.is_cuda
            and 0 < nbytes <= self.capacity
            and nbytes % _ALIGN == 0
            and x.data_ptr() % _ALIGN == 0  # the kernel writes the sum into x with vector stores
            and x.is_contiguous()
        )

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (ordered on the current stream; CUDA graphs capture both launches)."""
        buffer = self._buffer
        assert buffer is not None, "all-reduce after close"
        staged = buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        # A separate copy, not one_shot_all_reduce_copy_out: that kernel signals its peers without a block-wide
        # barrier after copying, so a peer could read elements another warp has not written yet.
        staged.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.name, x)
        return x

    def abort(self) -> None:
        """A peer died: kernels waiting for its flags would never end, and no NCCL abort reaches them. Force the
        flags for a while so queued work drains (its results are garbage; the engine is dead), and keep the
        buffer for the rest of the process rather than free it under a kernel that may still run."""
        if self._closed:
            return
        self._closed = True
        if self._drain is not None:
            self._drain.start()
        unregister_group(self.name)
        # Never freed, not even when the interpreter exits: freeing synchronizes the device (torch unmaps the
        # peers' memory), which would hang for good if a kernel still waited for the dead peer.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object((self._buffer, self._kept)))

    def close(self) -> None:
        """Release the buffer and the registration (the device must be idle: the engine has stopped)."""
        if self._closed:
            return
        self._closed = True
        unregister_group(self.name)
        self._drain = None  # views of the signal pads: never touched again
        self._kept.clear()
        self._buffer = None  # the last reference: torch unmaps every rank's memory (after a device sync)


def register_group(name: str, backend: Any, store: Any, rank: int, world_size: int, device_type: str) -> Any:
    """Wrap a bare c10d backend (ProcessGroupNCCL on "cuda") in a `ProcessGroup` over `store`, registered in
    torch's process-group registry as `name`, where symmetric memory finds a group's rank, size and store. The
    registry holds groups weakly: the caller keeps the returned group alive, and unregisters it."""
    from torch._C._distributed_c10d import ProcessGroup, _register_process_group

    kind = ProcessGroup.BackendType.NCCL if device_type == "cuda" else ProcessGroup.BackendType.GLOO
    group_name = cast("GroupName", name)
    group = ProcessGroup(store, rank, world_size)
    group._set_default_backend(kind)
    group._register_backend(torch.device(device_type), kind, backend)
    group._set_group_name(group_name)  # after the backend: the name lives on it
    _register_process_group(group_name, group)
    return group


def unregister_group(name: str) -> None:
    from torch._C._distributed_c10d import _unregister_process_group

    _unregister_process_group(cast("GroupName", name))


def _rendezvous(buffer: torch.Tensor, name: str, rank: int, world_size: int, store: SequenceAlignedStore) -> Any:
    from torch._C._distributed_c10d import _SymmetricMemory

    try:
        handle = _SymmetricMemory.rendezvous(buffer, name)
    except RuntimeError as exc:
        # torch before 2.11 finds a group's store in its own table (set_group_info), not the group registry;
        # it fails here before any exchange, on every rank alike. Later versions are not given the table:
        # with it, they check every all-reduce's buffer through the store.
        if "group info" not in str(exc):
            raise
        _SymmetricMemory.set_group_info(name, rank, world_size, store)
        handle = _SymmetricMemory.rendezvous(buffer, name)
    if handle is None:
        raise RuntimeError("symmetric-memory rendezvous returned no handle")
    return handle


class _Drain:
    """The signal-pad flags one_shot_all_reduce waits on, and a thread that forces them after a peer died.

    Its barrier, per thread block b: put 1 in each peer's slot [b, rank], then wait for 1 in our slot [b, peer]
    and reset it. Setting our slots to 1 and peers' slots [b, rank] to 0, again and again, lets every waiting
    barrier pass. The views are made at set-up, so abort allocates nothing."""

    def __init__(self, handle: Any, rank: int, world_size: int, device: torch.device) -> None:
        n = _MAX_BLOCKS * world_size
        peers = [p for p in range(world_size) if p != rank]
        own = handle.get_signal_pad(rank, [n], torch.int32, 0).view(_MAX_BLOCKS, world_size)
        self._ours = [own[:, p] for p in peers]  # [blocks]: where peer p's signals arrive
        self._theirs = [
            handle.get_signal_pad(p, [n], torch.int32, 0).view(_MAX_BLOCKS, world_size)[:, rank] for p in peers
        ]  # [blocks]: where our signals go in peer p's pad
        self._device = device
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # beside a spinning kernel

    def start(self) -> None:
        threading.Thread(target=self._run, name="asyncllm-symm-drain", daemon=True).start()

    def _run(self) -> None:
        deadline = time.monotonic() + _DRAIN_S
        try:
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                while time.monotonic() < deadline:
                    for flags in self._ours:
                        flags.fill_(1)
                    for flags in self._theirs:
                        flags.fill_(0)
                    time.sleep(0.001)
        except Exception:
            logger.exception("draining the custom all-reduce after a peer died failed")
