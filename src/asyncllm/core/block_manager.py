"""KV block accounting with reference counts and a prefix cache.

Owns which physical block holds which request's tokens, and the index from prefix hash to block. Knows
nothing of tensors: the runner receives block ids and writes KV where it is told.

Life of a block: free (maybe still cached) -> held by one or more requests (ref_count > 0) -> free again,
appended to the LRU end. A free block keeps its hash so a later request with the same prefix can take it
back; when it is taken for other content it leaves the hash index first, so the index never points at KV
that is not what the hash says. With KV tiers below the device (`kv_tiers.py`) a block taken for other
content is copied down first, and a prefix continues from the host tier into fresh blocks the step fills
beside its forward pass, for its request to compute on from the next step (`restores`). Blocks read from disk
for a waiting request are restored as they arrive, into free blocks registered as cached (`take_transfers`):
the request, admitted once its last read is in, finds them on the device.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from asyncllm.core.block_hash import ROOT_HASH, extend_block_digests, extend_block_hashes, root_hash
from asyncllm.core.kv_tiers import KVTiers
from asyncllm.core.request import Request
from asyncllm.step import KVTierInfo, KVTransfers


class KVBlock:
    __slots__ = ("block_digest", "block_hash", "block_id", "from_disk", "pending", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id  # -1: a prefix hit in the host tier, not on the device yet (`find_cached_prefix`)
        self.ref_count = 0
        self.block_hash: int | None = None
        # With a disk tier, the 128-bit digest of the prefix `block_hash` names (`extend_block_digests`), which
        # its file carries; None without one, and for an adapter's block (adapter ids are one engine's: never on disk).
        self.block_digest: bytes | None = None
        self.pending = False  # registered by a step whose KV is not written yet
        self.from_disk = False  # restored from disk ahead of its request, and not hit since (a disk hit)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, tiers: KVTierInfo | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is the least recently freed.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # block hash -> block holding exactly that prefix
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already offered to the cache
        # Registered while planning steps still in flight, whose KV is not written yet: committed (in order)
        # when each step has run, withdrawn if one fails. Entries are (registration number, block); a step's
        # mark is the number reached when it was planned. Also each request's registered count before them.
        self._pending: deque[tuple[int, KVBlock]] = deque()
        self._num_registrations = 0
        self._pending_counts: dict[str, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # The tiers below the device (None: none, or no prefix caching), and the hit tokens restored from
        # them: by the last allocation, and in all (of first admissions, as the hit rate's terms).
        self.tiers = KVTiers(tiers) if tiers is not None and enable_prefix_caching else None
        self._restored = (0, 0)
        self._promised = 0  # free blocks the requests staged by the step being planned take in the next (`stage`)
        self.num_host_hit_tokens = 0
        self.num_disk_hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included."""
        return len(self._free)

    @property
    def num_unpromised_blocks(self) -> int:
        """Free blocks no request staged by the step being planned is owed (`stage`): what optional takers (a
        draft model's lookahead) may use without pushing a staged request's blocks into a preemption."""
        return len(self._free) - self._promised

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def free_block_ids(self) -> list[int]:
        """Blocks no request holds, in eviction order (the first is taken next)."""
        return list(self._free)

    def cached_blocks(self) -> dict[int, KVBlock]:
        """A copy of the prefix index: block hash -> the block holding exactly that prefix."""
        return dict(self._cached)

    def held_block_ids(self, request: Request) -> list[int]:
        """The blocks `request` references: its whole table (a windowed manager gives some back early)."""
        return request.block_ids

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of leading full blocks of `request` already in the cache (no references taken).

        At most `(num_tokens - 1) // block_size` blocks: the last token is always computed, since its
        logits are what the next sample needs.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        root = root_hash(request.lora_id) if request.lora_id else ROOT_HASH  # an adapter's KV is its own
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, max_blocks, root)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.tiers is not None and len(hits) < max_blocks:  # the prefix may go on in the host tier
            hits += map(_host_hit, self.tiers.host_run(request.block_hashes[len(hits) : max_blocks]))
        return hits

    def awaits_load(self, request: Request, num_hits: int) -> bool:
        """Whether `request`, whose prefix hits `num_hits` blocks (`find_cached_prefix`), waits for the
        next of its blocks to be read from disk (`KVTiers.awaits`)."""
        if self.tiers is None or not self.tiers.has_disk or request.lora_id:
            return False
        max_blocks = (request.num_tokens - 1) // self.block_size
        extend_block_digests(request.block_digests, request.all_token_ids, self.block_size, max_blocks)
        return self.tiers.awaits(
            request.request_id, request.block_hashes[num_hits:max_blocks], request.block_digests[num_hits:max_blocks]
        )

    def restores(self, cached: list[KVBlock]) -> bool:
        """Whether prefix hits `cached` (`find_cached_prefix`, or a sibling's) need blocks restored by the step
        being planned: their request computes from the next step on, once the copies are in (`KVTiers`)."""
        if self.tiers is None:
            return False
        return any(b.block_id < 0 for b in cached) or self.tiers.restoring([b.block_id for b in cached])

    def may_restore(self, cached: list[KVBlock]) -> bool:
        """Whether the step being planned may restore the host-tier hits among `cached` (`KVTiers.may_restore`)."""
        return self.tiers is None or self.tiers.may_restore(sum(1 for b in cached if b.block_id < 0))

    def take_transfers(self) -> KVTransfers | None:
        """The copies to and from the tiers below the device that the step just planned needs, with the
        restores of blocks just read from disk (`_restore_arrivals`)."""
        if self.tiers is not None:
            self._restore_arrivals(self.tiers)  # within the free blocks staged requests are not owed
        self._promised = 0
        return self.tiers.take_step() if self.tiers is not None else None

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup for the hit rate (only admissions that succeed are counted)."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens
        self.num_host_hit_tokens += self._restored[0]
        self.num_disk_hit_tokens += self._restored[1]

    # ------------------------------------------------------------------ changes
    def allocate(self, request: Request, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens after its computed (and cached) ones.

        `cached` are prefix hits from `find_cached_prefix`, taken only if everything fits. Returns False and
        changes nothing when memory is short.
        """
        block_size = self.block_size
        if not cached:
            num_tokens = request.num_computed_tokens + num_new_tokens
            # The common decode step: the last block has room and no full block awaits registration.
            if num_tokens <= len(request.block_ids) * block_size and (
                not self.enable_prefix_caching
                or min(num_tokens, request.num_tokens) // block_size <= self._num_registered.get(request.request_id, 0)
            ):
                return True
            cached = []
        else:
            num_tokens = request.num_computed_tokens + len(cached) * block_size + num_new_tokens
        num_new_blocks = -(-num_tokens // block_size) - len(request.block_ids) - len(cached)
        num_cached_free = sum(1 for b in cached if b.ref_count == 0)  # host-tier hits take a free block too
        if max(num_new_blocks, 0) + num_cached_free + self._promised > len(self._free):
            return False
        restored = [b.block_hash for b in cached if b.block_id < 0 and b.block_hash is not None]
        if restored:
            assert self.tiers is not None
            self.tiers.pin(restored)  # before this allocation's evictions look for host slots
        from_disk = prefetched = 0
        for block in cached:
            if block.block_id < 0:  # in the host tier: a fresh block, filled by the step before its forward pass
                assert self.tiers is not None and block.block_hash is not None
                fresh = self._take_free_block()
                from_disk += self.tiers.restore(block.block_hash, fresh.block_id)
                request.block_ids.append(fresh.block_id)
                continue
            if block.ref_count == 0:
                del self._free[block.block_id]
            prefetched += block.from_disk
            block.from_disk = False
            block.ref_count += 1
            request.block_ids.append(block.block_id)
        self._restored = ((len(restored) - from_disk) * block_size, (from_disk + prefetched) * block_size)
        for _ in range(max(num_new_blocks, 0)):
            request.block_ids.append(self._take_free_block().block_id)
        if self.enable_prefix_caching:
            # Registered now so a request admitted later in the same step shares these blocks: every layer
            # stores the step's keys and values before its attention reads any. Pending until the step runs.
            self._register_full_blocks(request, num_tokens)
        return True

    def stage(self, request: Request, num_new_tokens: int, cached: list[KVBlock]) -> bool:
        """`allocate` of the prefix hits `cached` alone, for a request that computes from the next step on (its
        blocks restored meanwhile: `restores`), if its next `num_new_tokens` would fit too. The hits' blocks are
        taken and registered (pending) now; the blocks of its new tokens are taken by the step that computes them.
        No request hits KV still being restored: `restores` sends a request sharing such blocks a step later too."""
        needed = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        if needed + sum(1 for b in cached if b.ref_count == 0) + self._promised > len(self._free):
            return False
        if not self.allocate(request, 0, cached):
            return False
        self._promised += needed  # kept from this step's later admissions (the next step's come after it)
        return True

    def pending_mark(self) -> int:
        """Taken right after planning a step: `commit_pending(mark)` commits what that step registered."""
        return self._num_registrations

    def commit_pending(self, mark: int | None = None, kv_loaded: tuple[bool, ...] | None = None) -> None:
        """The step planned up to `mark` (None: every planned step) has run: the blocks registered while
        planning it now hold the KV their hashes promise, and the disk reads its output reports (`kv_loaded`:
        `ModelRunnerOutput.kv_loaded`) are in."""
        if kv_loaded is not None and self.tiers is not None:
            self.tiers.loaded(kv_loaded)
        while self._pending and (mark is None or self._pending[0][0] < mark):
            _, block = self._pending.popleft()
            block.pending = False
            if self.tiers is not None and block.ref_count == 0 and block.block_hash is not None:
                self.tiers.freed(block)
        if not self._pending:
            self._pending_counts.clear()

    def discard_pending(self) -> None:
        """A planned step failed or was interrupted: withdraw the hashes of blocks no finished step wrote, so
        no later request is served KV that does not exist."""
        for _, block in self._pending:
            if block.block_hash is not None and self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.pending = block.from_disk = False
        for request_id, count in self._pending_counts.items():
            if request_id in self._num_registered:
                self._num_registered[request_id] = count
        self.commit_pending()

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a shared head outlives its private tail in the LRU."""
        self.release(request.block_ids)
        request.block_ids.clear()
        self._num_registered.pop(request.request_id, None)
        if self.tiers is not None:
            self.tiers.forget(request.request_id)

    def hold(self, block_ids: list[int]) -> None:
        """One more reference on blocks a request holds, for a holder that is no request (a sample group
        keeping its prompt's blocks for samples not admitted yet); `release` gives it back."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} held while free"
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, tail first; a block nobody references is free again."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = block
                if block.block_hash is None:  # nothing a later prefix could reuse: the first block taken again,
                    self._free.move_to_end(block_id, last=False)  # before a cached one or one never written yet
                if self.tiers is not None and block.block_hash is not None and not block.pending:
                    self.tiers.freed(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks stay where they are)."""
        for block in self._cached.values():
            block.block_hash = None
            block.from_disk = False
        self._cached.clear()
        if self.tiers is not None:
            self.tiers.reset()

    # ------------------------------------------------------------------ internals
    def _restore_arrivals(self, tiers: KVTiers) -> None:
        """Restore the blocks just read from disk (`KVTiers.arrivals`) into free blocks, registered under their
        hashes as free cached blocks (the last to be taken) and pending until this step has run: their waiting
        request finds them on the device, and the copies overlap the reads still out. Only into free blocks whose
        reuse copies nothing down (uncached, or in the host tier already: an offload would hold up the step's
        forward pass), within the step's restore bound and its free blocks not owed to staged requests; the
        rest waits for the next step. A request admitted in this step that hits them computes from the next
        (`restores`)."""
        arrived = tiers.arrivals()
        tiers.pin([block_hash for block_hash, _ in arrived])  # no eviction below reuses their host slots
        for i, (block_hash, digest) in enumerate(arrived):
            if block_hash in self._cached:
                continue  # on the device already (computed meanwhile)
            head = next(iter(self._free.values()), None)
            # The next free block was restored ahead too and not taken by its request yet, or is registered by a
            # step in flight (the device holds no more arrivals without undoing some), or would be copied down
            # first; or the step's restores are at their bound.
            full = head is None or head.pending or head.from_disk or len(self._free) <= self._promised
            copies = head is not None and head.block_hash is not None and not tiers.holds(head.block_hash)
            if full or copies or not tiers.may_restore(1):
                tiers.defer(arrived[i:])
                return
            block = self._take_free_block()
            block.from_disk = tiers.restore(block_hash, block.block_id)
            block.ref_count = 0
            block.block_hash, block.block_digest, block.pending = block_hash, digest, True
            self._free[block.block_id] = block  # the last free block taken
            self._cached[block_hash] = block
            self._pending.append((self._num_registrations, block))
            self._num_registrations += 1

    def _take_free_block(self) -> KVBlock:
        _, block = self._free.popitem(last=False)
        if block.from_disk and self.tiers is not None and block.block_hash is not None:
            self.tiers.unused_arrival(block.block_hash)  # its request restores it from the host tier: a disk hit
        block.from_disk = False
        if block.block_hash is not None:
            if self.tiers is not None and not block.pending:
                self.tiers.evicting(block)  # copied down first (or already there)
            # Reused for other content: it must leave the index before anything is written into it.
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks holding the first `num_tokens` tokens' KV that are full."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        root = root_hash(request.lora_id) if request.lora_id else ROOT_HASH
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_full, root)
        self._pending_counts.setdefault(request.request_id, start)
        on_disk = self.tiers is not None and self.tiers.has_disk and not request.lora_id
        if on_disk:
            extend_block_digests(request.block_digests, request.all_token_ids, self.block_size, num_full)
        for i in range(start, num_full):
            block = self.blocks[request.block_ids[i]]
            block_hash = request.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                block.block_digest = request.block_digests[i] if on_disk else None
                block.pending = True
                self._cached[block_hash] = block
                self._pending.append((self._num_registrations, block))
                self._num_registrations += 1
        self._num_registered[request.request_id] = num_full


def _host_hit(block_hash: int) -> KVBlock:
    """A prefix hit in the host tier: a stand-in block (id -1) that `allocate` replaces by a fresh one."""
    block = KVBlock(-1)
    block.block_hash = block_hash
    return block
