"""`HostKVPool`: the host tier's memory and the copies of whole KV blocks between it and the device cache.

A slot holds one block of every layer, keys then values, as bytes: [2 * num_layers, block_size, num_kv_heads,
head_dim * element size] uint8, contiguous (one file's payload on disk, one DMA each way). Bytes because an FP8
cache's codes copy as they are (its scales are per layer and fixed) and every dtype copies alike.

On CUDA the pool is pinned (registered with the driver, not rounded up as torch's pinned allocator rounds) and
the copies run on two side streams, one each way, each with a staging buffer in the device's memory: a device
block's layers are gathered into staging, then each run of consecutive slots crosses in one DMA; restores cross
into staging, then scatter into the blocks. Restores have a stream of their own so that they never queue behind
the copies to the host, and the forward pass of the step that issues them does not wait for them: the next
step's work does (`join_restores`). Other ordering is the caller's (`begin`, `join`, `record`). On CPU the same
gathers and scatters run in place, at once (the slow twin: the same bytes, no streams).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Iterator

import torch

from asyncllm.layers.host_copy import to_device

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key, value), each [num_blocks, bs, Hkv, D]


class HostKVPool:
    def __init__(
        self,
        caches: KVCaches,
        num_slots: int,
        device: torch.device,
        staging_bytes: int = 64 << 20,
        shared: bool = False,
    ) -> None:
        """`shared`: the slots in memory another process can map (`shared_fd`, Linux): the disk tier's reader
        process fills them (`kv_reader.py`)."""
        # Every layer's keys and values as bytes: [num_blocks, block_size, Hkv, D * element size] each.
        self.layers = [t.view(torch.uint8) for kv in caches for t in kv]
        # [2L, num_blocks, bs, Hkv, D bytes] over all of them where they are views of one allocation (kv_cache.py's):
        # a block of every layer then moves in one launch, not one a layer.
        self._stacked = _stacked(self.layers)
        self.block_shape = (len(self.layers), *self.layers[0].shape[1:])  # [2L, bs, Hkv, D bytes]
        self.block_bytes = self.layers[0][0].numel() * len(self.layers)
        self.device = device
        self.cuda = device.type == "cuda"
        shape = (num_slots, *self.block_shape)  # [S, 2L, bs, Hkv, D bytes]
        self.shared_fd: int | None = None  # the slots' memory file, where another process may map them
        host = None
        if shared and hasattr(os, "memfd_create"):
            try:
                self.shared_fd, host = _shared(shape)
            except OSError as exc:
                logger.warning("the KV host tier's shared memory failed (%s): the disk tier reads in this process", exc)
        self.host = host if host is not None else torch.empty(shape, dtype=torch.uint8)
        self._registered = self.cuda and _pin(self.host)
        if self.cuda and not self._registered and self.shared_fd is not None:
            logger.warning("pinning the KV host tier's shared memory failed: the disk tier reads in this process")
            self._close_shared()
            self.host = torch.empty(shape, dtype=torch.uint8)
            self._registered = _pin(self.host)
        if self.cuda and not self._registered:
            logger.warning("pinning the KV host tier failed: its copies go through pageable memory, slower")
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.restore_stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        chunk = max(1, staging_bytes // self.block_bytes)
        self._staging = torch.empty((chunk, *self.block_shape), dtype=torch.uint8, device=device) if self.cuda else None
        self._restore_staging = torch.empty_like(self._staging) if self._staging is not None else None
        self._restored: torch.cuda.Event | None = None  # fires once the restores issued and not joined have landed

    @property
    def num_slots(self) -> int:
        return self.host.shape[0]

    def slot(self, index: int) -> torch.Tensor:
        """One slot's bytes, [2L, bs, Hkv, D bytes] (a view: the disk tier reads and fills it in place)."""
        return self.host[index]

    # ------------------------------------------------------------------ ordering (CUDA; no-ops on CPU)
    @property
    def restoring(self) -> bool:
        """Restores were issued that no later work has been ordered after yet (`join_restores`)."""
        return self._restored is not None

    def join_restores(self) -> None:
        """Work queued on the compute stream from now on (and copies after the next `begin`) starts after every
        restore issued so far: the blocks they fill are whole for whatever reads, writes or frees them next."""
        if self._restored is not None:
            torch.cuda.current_stream(self.device).wait_event(self._restored)
            self._restored = None

    def begin(self) -> None:
        """Copies issued from now on start after everything already queued on the compute stream (the KV
        the forward passes before wrote, and their reads of blocks about to be overwritten)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def join(self) -> None:
        """Work queued on the compute stream from now on starts after every copy issued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def record(self) -> torch.cuda.Event | None:
        """An event that fires once every copy issued so far has landed (None on CPU: they have)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        """Wait on the host until every copy issued so far, either way, has landed."""
        if self.stream is not None and self.restore_stream is not None:
            self.stream.synchronize()
            self.restore_stream.synchronize()

    # ------------------------------------------------------------------ copies
    @torch.inference_mode()
    def to_host(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots: `pairs` of (block id, slot)."""
        if not pairs:
            return
        if self._staging is None:
            ids, slots = _columns(pairs)
            self.host.index_copy_(0, slots, self._gather(ids))
            return
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            for chunk in _chunks(pairs, self._staging.shape[0]):
                n = len(chunk)
                ids = to_device([b for b, _ in chunk], torch.int64, self.device)
                self._staging[:n].copy_(self._gather(ids))
                for slot, i, run in _runs([s for _, s in chunk]):
                    self.host[slot : slot + run].copy_(self._staging[i : i + run], non_blocking=True)

    @torch.inference_mode()
    def to_device(self, pairs: list[tuple[int, int]], after_copies: bool = False) -> None:
        """Copy host slots into device blocks: `pairs` of (slot, block id), on the restore stream, after the
        work queued on the compute stream (forward passes may still read the blocks, freed meanwhile) and, with
        `after_copies`, the copies to the host issued so far (some read blocks these overwrite). Nothing waits
        for them until `join_restores`."""
        if not pairs:
            return
        if self._restore_staging is None:
            slots, ids = _columns(pairs)
            self._scatter(ids, self.host.index_select(0, slots))
            return
        stream, staging = self.restore_stream, self._restore_staging
        assert stream is not None and self.stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after_copies:
            stream.wait_stream(self.stream)
        with torch.cuda.stream(stream):
            for chunk in _chunks(pairs, staging.shape[0]):
                n = len(chunk)
                for slot, i, run in _runs([s for s, _ in chunk]):
                    staging[i : i + run].copy_(self.host[slot : slot + run], non_blocking=True)
                self._scatter(to_device([b for _, b in chunk], torch.int64, self.device), staging[:n])
        self._restored = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._restored.record(stream)

    def close(self) -> None:
        """Unpin the pool (after the last copy: the caller synchronized)."""
        if self._registered:
            self.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())  # type: ignore[no-untyped-call]
            self._registered = False
        self._close_shared()

    def _close_shared(self) -> None:
        """Close the memory file (its mapping stays while the slots are referenced)."""
        if self.shared_fd is not None:
            os.close(self.shared_fd)
            self.shared_fd = None

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The blocks `ids` of every layer, [n, 2L, bs, Hkv, D bytes]."""
        stacked = self._stacked
        if stacked is None:
            return torch.stack([t.index_select(0, ids) for t in self.layers], dim=1)
        if _widens(stacked):  # 8 bytes an element, as `_scatter`
            return stacked.view(torch.int64).index_select(1, ids).view(torch.uint8).transpose(0, 1)
        return stacked.index_select(1, ids).transpose(0, 1)

    def _scatter(self, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """`blocks` ([n, 2L, bs, Hkv, D bytes]) into the blocks `ids` of every layer."""
        if self._stacked is not None:
            dst, src = self._stacked, blocks.transpose(0, 1)
            if _widens(dst) and _widens(src):  # both or neither: index_copy_ takes one dtype
                dst, src = dst.view(torch.int64), src.view(torch.int64)
            dst.index_copy_(1, ids, src)
            return
        for j, t in enumerate(self.layers):
            t.index_copy_(0, ids, blocks[:, j])


def _stacked(layers: list[torch.Tensor]) -> torch.Tensor | None:
    """The layers' byte views as one [2L, num_blocks, ...] view where each is contiguous and they sit at one
    spacing in one allocation; None otherwise (the copies then take one launch a layer)."""
    first = layers[0]
    storage = first.untyped_storage().data_ptr()
    spacing = layers[1].data_ptr() - first.data_ptr() if len(layers) > 1 else first.numel()
    for i, t in enumerate(layers):
        if not t.is_contiguous() or t.shape != first.shape or t.untyped_storage().data_ptr() != storage:
            return None
        if t.data_ptr() - first.data_ptr() != i * spacing:
            return None
    if spacing < first.numel():
        return None
    return first.as_strided((len(layers), *first.shape), (spacing, *first.stride()))


def _widens(t: torch.Tensor) -> bool:
    """Whether bytes `t` can be viewed 8 at a time (rows of whole, aligned words): index_copy_ then moves an eighth
    of the elements."""
    return (
        t.shape[-1] % 8 == 0
        and t.stride(-1) == 1
        and t.data_ptr() % 8 == 0
        and all(s % 8 == 0 for s in t.stride()[:-1])
    )


def _shared(shape: tuple[int, ...]) -> tuple[int, torch.Tensor]:
    """An anonymous memory file of `shape` bytes and the slots over its shared mapping (pages made as written,
    or as pinning makes them)."""
    size = math.prod(shape)
    fd = os.memfd_create("asyncllm-kv-host", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        os.close(fd)
        raise
    return fd, torch.frombuffer(mapping, dtype=torch.uint8).view(shape)  # the tensor holds the mapping


def _pin(host: torch.Tensor) -> bool:
    """Page-lock `host` in place (cudaHostRegister): DMA reads and writes it directly, at the link's speed."""
    result = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)  # type: ignore[no-untyped-call]
    return int(getattr(result, "value", result)) == 0


def _columns(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = zip(*pairs, strict=True)
    return torch.tensor(first, dtype=torch.int64), torch.tensor(second, dtype=torch.int64)


def _chunks(pairs: list[tuple[int, int]], size: int) -> Iterator[list[tuple[int, int]]]:
    for start in range(0, len(pairs), size):
        yield pairs[start : start + size]


def _runs(slots: list[int]) -> Iterator[tuple[int, int, int]]:
    """(first slot, first index, length) of each run of consecutive slots at consecutive indices."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield slots[start], start, i - start
            start = i
