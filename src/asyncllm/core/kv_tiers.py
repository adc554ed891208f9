"""`KVTiers`: the engine core's index of the KV tiers below the device (a host-memory pool, and a disk
directory), keyed by the prefix cache's block hashes; it plans every copy between them and the device as a
step's `KVTransfers`, which every rank runs on its shard (`worker/kv_tiers.py`).

A cached block leaves the device through the host tier only. The pool's free cached blocks are copied to host
slots oldest-freed first, a bounded number per step (`ahead`, overlapping the forward pass), so that one the
pool takes for other content is usually there already; if not, the step copies it before its forward pass
(`offloads`). Host slots are reused least recently used first. A prefix that misses on the device and
continues in the host tier is restored a step ahead: the block manager takes fresh device blocks for it, the
step copies the slots into them beside its forward pass (`restores`), and the request computes from the next
step on, whose work the worker orders after those copies; a request admitted in the step that restores blocks
it hits waits for the next step too (`restoring`). With a disk tier every block copied to the host is also
written to disk in the background (`writes`; never a LoRA adapter's: adapter ids are one engine's). A prefix
that continues on disk is read into host slots on the workers' threads beside the steps (`loads`) while its
request waits, once, and later requests go first; later steps' outputs say which reads finished, in the order
they were sent, and which blocks arrived intact on every rank (`loaded`). Those are restored into free device
blocks as they arrive (`arrivals`: the block manager registers them as cached there), so the copies to the
device overlap the reads still out and the request, admitted once its last read is in, finds its prefix on the
device. While reads are out every step carries copies (maybe none), so the engine keeps polling for them.

What a hash names never changes within an engine: it covers the whole prefix and the adapter, and the model
and KV layout are the engine's (the disk tier's files also carry a fingerprint of them, checked on reading).
Across engines a 64-bit hash is not proof enough: each write and load carries the block's 128-bit digest of
its whole prefix (`block_hash.extend_block_digests`), which the file holds and the read compares.
Plain Python, no clocks: deterministic like the block manager that drives it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

from asyncllm.step import KVTierInfo, KVTransfers, ModelExecutor, SchedulerOutput


class KVBlock(Protocol):
    """What the tiers read of a device block (`block_manager.KVBlock`)."""

    block_id: int
    block_hash: int | None
    block_digest: bytes | None  # the digest of its prefix, kept on disk with it (None: never on disk)
    ref_count: int
    pending: bool  # registered by a step whose KV is not written yet


class KVTiers:
    def __init__(self, info: KVTierInfo) -> None:
        if info.host_blocks < 1:
            raise ValueError(f"a host tier needs host_blocks >= 1, got {info.host_blocks}")
        self.info = info
        self._free_slots = list(range(info.host_blocks - 1, -1, -1))  # pop() takes the lowest: runs of slots
        self._host: OrderedDict[int, int] = OrderedDict()  # block hash -> slot; the first is reused next
        self._from_disk: set[int] = set()  # host entries read from disk and not restored since (hit counts)
        self._disk: OrderedDict[int, None] = OrderedDict.fromkeys(info.on_disk)  # believed on disk, oldest first
        self._to_load: OrderedDict[int, tuple[int, bytes]] = OrderedDict()  # hash -> (reserved slot, digest)
        self._loading: deque[tuple[int, int, bytes]] = deque()  # reads sent and not reported, in the order sent
        self._arrived: list[tuple[int, bytes]] = []  # (hash, digest) read from disk since `arrivals` took them
        self._in_load: set[int] = set()  # hashes queued or being loaded
        self._waited: set[str] = set()  # requests that waited for loads (each waits once per admission)
        self._freed: OrderedDict[int, tuple[KVBlock, int]] = OrderedDict()  # block id -> (block, its hash)
        self._recent_ahead: set[int] = set()  # device blocks whose `ahead` copy may still run
        self._pinned: set[int] = set()  # slots this step copies into or out of: none is reused within it
        self._restoring: set[int] = set()  # device blocks this step restores (no forward pass reads them in it)
        self._step = KVTransfers()
        self._wait = False

    @property
    def has_disk(self) -> bool:
        return self.info.disk_blocks > 0

    # ------------------------------------------------------------------ lookups
    def host_run(self, hashes: list[int]) -> list[int]:
        """The leading hashes of `hashes` (a prefix's blocks past its device hits) that the host tier holds."""
        run = []
        for block_hash in hashes:
            if block_hash not in self._host:
                break
            run.append(block_hash)
        return run

    def awaits(self, request_id: str, hashes: list[int], digests: list[bytes]) -> bool:
        """Whether the request must wait for disk reads: `hashes` are its prefix's blocks past its device and
        host hits (`digests`, theirs). True while the first is on its way; when it is on disk and the request has
        not waited since it was last admitted, its run on disk (at most half the host tier) is queued for loading
        first, each read checked against its digest."""
        if not hashes or not self.has_disk:
            return False
        if hashes[0] in self._in_load:
            return True
        if hashes[0] not in self._disk or request_id in self._waited:
            return False
        self._waited.add(request_id)
        run = max(1, self.info.host_blocks // 2)
        for block_hash, digest in zip(hashes[:run], digests[:run], strict=True):
            if block_hash in self._host or block_hash in self._in_load:
                continue  # there already, or coming for another request
            if block_hash not in self._disk:
                break
            slot = self._take_slot()
            if slot is None:
                break
            self._to_load[block_hash] = (slot, digest)
            self._in_load.add(block_hash)
        return hashes[0] in self._in_load

    def holds(self, block_hash: int) -> bool:
        """Whether the host tier holds `block_hash` (a device block of it is taken for other content at no copy)."""
        return block_hash in self._host

    def may_restore(self, num_blocks: int) -> bool:
        """Whether the step being planned may restore `num_blocks` more (`KVTierInfo.restores_per_step`): the
        next step's work waits for its restores, so a step restoring more than its own forward pass hides stalls
        every request in it. The step's first restore is never refused: a history past the bound still comes."""
        limit = self.info.restores_per_step
        restores = self._step.restores
        return limit <= 0 or num_blocks == 0 or not restores or len(restores) + num_blocks <= limit

    def restoring(self, block_ids: list[int]) -> bool:
        """Whether any of `block_ids` is restored by the step being planned (its forward pass may not read it)."""
        return bool(self._restoring) and not self._restoring.isdisjoint(block_ids)

    def forget(self, request_id: str) -> None:
        """The request's blocks were freed (it finished, or was preempted): it may wait for loads again."""
        self._waited.discard(request_id)

    # ------------------------------------------------------------------ the block manager's events
    def pin(self, hashes: list[int]) -> None:
        """Host entries a request is about to restore: kept through this step's other copies."""
        for block_hash in hashes:
            self._pinned.add(self._host[block_hash])

    def restore(self, block_hash: int, block_id: int) -> bool:
        """Copy the host entry `block_hash` into the fresh device block `block_id` beside this step's forward
        pass, for the next step; True when it came from disk (the first restore since it was read)."""
        slot = self._host[block_hash]
        self._host.move_to_end(block_hash)
        self._step.restores.append((slot, block_id))
        self._pinned.add(slot)
        self._restoring.add(block_id)
        if block_hash in self._from_disk:
            self._from_disk.discard(block_hash)
            return True
        return False

    def evicting(self, block: KVBlock) -> None:
        """`block`, free and cached with its KV written, is taken for other content this step: copied to the
        host before the forward pass overwrites it, unless it is there already."""
        block_hash = block.block_hash
        assert block_hash is not None
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            if block.block_id in self._recent_ahead:
                self._wait = True  # its copy may still be running: the forward pass waits for it
            return
        slot = self._take_slot()
        if slot is not None:
            self._step.offloads.append((block.block_id, slot))
            self._keep(block, slot)

    def freed(self, block: KVBlock) -> None:
        """`block` became free with its KV written and cached: a candidate for an `ahead` copy."""
        assert block.block_hash is not None
        if block.block_hash not in self._host:
            self._freed.pop(block.block_id, None)
            self._freed[block.block_id] = (block, block.block_hash)

    def loaded(self, results: tuple[bool, ...]) -> None:
        """The oldest reads sent have finished (`ModelRunnerOutput.kv_loaded`, one entry per read, in the order
        sent): the blocks that arrived on every rank join the host tier."""
        if len(results) > len(self._loading):
            raise RuntimeError(f"{len(results)} disk reads reported finished, but {len(self._loading)} are out")
        for ok in results:
            block_hash, slot, digest = self._loading.popleft()
            self._in_load.discard(block_hash)
            if ok and block_hash not in self._host:
                self._host[block_hash] = slot
                self._from_disk.add(block_hash)
                self._arrived.append((block_hash, digest))
                continue
            self._free_slots.append(slot)
            if not ok:  # missing, corrupted or another prefix's on some rank (the worker warned): recomputed
                self._disk.pop(block_hash, None)

    def arrivals(self) -> list[tuple[int, bytes]]:
        """The blocks read from disk since the last call, (hash, prefix digest), that the host tier still holds
        and no restore took yet, in the order they arrived (the block manager restores them ahead of their
        request)."""
        arrived, self._arrived = self._arrived, []
        return [entry for entry in arrived if entry[0] in self._from_disk]

    def unused_arrival(self, block_hash: int) -> None:
        """A block restored ahead from `arrivals` leaves the device before its request took it: a later restore
        of its host entry still counts as a disk hit."""
        if block_hash in self._host:
            self._from_disk.add(block_hash)

    def defer(self, arrived: list[tuple[int, bytes]]) -> None:
        """`arrivals` not restored by this step (its restore bound, or no free block to take without a copy
        down): offered again next step."""
        self._arrived[:0] = arrived

    def reset(self) -> None:
        """Forget every host entry, and what is on disk (the files stay for a later engine)."""
        self._free_slots += [slot for slot in self._host.values() if slot not in self._pinned]
        self._host = OrderedDict((h, s) for h, s in self._host.items() if s in self._pinned)
        self._from_disk.clear()
        self._arrived.clear()
        self._disk.clear()
        self._freed.clear()

    # ------------------------------------------------------------------ the step's copies
    def take_step(self, ahead_blocks: int | None = None) -> KVTransfers | None:
        """The copies planned for the step being planned, with its `ahead` copies (at most `ahead_blocks`,
        by default the tier's per-step count) and the disk reads it may start; None when there are none and no
        read is out (the step then polls for them)."""
        self._plan_ahead(self.info.ahead_blocks if ahead_blocks is None else ahead_blocks)
        step, self._step = self._step, KVTransfers()
        if self._to_load:
            taken = [self._to_load.popitem(last=False) for _ in range(min(len(self._to_load), self._loads_per_step))]
            batch = [(block_hash, slot, digest) for block_hash, (slot, digest) in taken]
            step.loads.extend(batch)
            self._loading.extend(batch)
        self._pinned.clear()
        self._restoring.clear()
        if not (step.before_forward or step.restores or step.ahead or self._wait or self._loading):
            return None
        wait, self._wait = self._wait, False
        # A forward pass that waits for the copies issued before it also outlasts their `ahead` copies.
        if step.before_forward or wait:
            self._recent_ahead.clear()
        self._recent_ahead.update(block_id for block_id, _ in step.ahead)
        return KVTransfers(step.offloads, step.loads, step.restores, step.ahead, step.writes, wait)

    def flush(self, executor: ModelExecutor) -> None:
        """Before the engine stops: with a disk tier, copy every free cached block not in the host tier yet
        there (and so to disk), in one step of copies alone; the worker finishes its writes as it shuts down."""
        if not self.has_disk or not self._freed:
            return
        kv = self.take_step(ahead_blocks=self.info.host_blocks)
        if kv is not None:
            executor.submit(SchedulerOutput(kv=kv)).result()

    # ------------------------------------------------------------------ internals
    @property
    def _loads_per_step(self) -> int:
        return max(1, self.info.loads_per_step)

    def _plan_ahead(self, budget: int) -> None:
        while budget > 0 and self._freed:
            _, (block, block_hash) = self._freed.popitem(last=False)
            # Taken since, or hit, or registered anew (its KV not written yet), or copied meanwhile: skip it.
            if block.ref_count or block.block_hash != block_hash or block.pending or block_hash in self._host:
                continue
            slot = self._take_slot()
            if slot is None:
                self._freed[block.block_id] = (block, block_hash)
                self._freed.move_to_end(block.block_id, last=False)
                return
            self._step.ahead.append((block.block_id, slot))
            self._keep(block, slot)
            budget -= 1

    def _keep(self, block: KVBlock, slot: int) -> None:
        """`block`'s copy lands in `slot`: index it, and keep it on disk too where it belongs there."""
        block_hash = block.block_hash
        assert block_hash is not None
        self._host[block_hash] = slot
        self._pinned.add(slot)
        if self.has_disk and block.block_digest is not None:
            if block_hash not in self._disk:
                self._step.writes.append((block_hash, slot, block.block_digest))
            self._disk[block_hash] = None
            self._disk.move_to_end(block_hash)
            while len(self._disk) > self.info.disk_blocks:
                self._disk.popitem(last=False)

    def _take_slot(self) -> int | None:
        """A host slot for a new entry: a free one, else the least recently used entry's (None: every slot
        is in use by this step)."""
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._host.items():
            if slot not in self._pinned:
                del self._host[block_hash]
                self._from_disk.discard(block_hash)
                return slot
        return None


def stop_executor(executor: ModelExecutor, tiers: KVTiers | None) -> None:
    """Release the device; first, with a disk tier, keep the free cached blocks on disk (`KVTiers.flush`). The
    executor stops even where that step fails (an engine that died)."""
    try:
        if tiers is not None:
            tiers.flush(executor)
    finally:
        executor.shutdown()
