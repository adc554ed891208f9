"""Which replica takes a request: least outstanding work, with prefix affinity.

A request whose prompt fills at least one KV block goes where the first request with the same first block
went, since that replica holds its prefix in cache (W3-like traffic keeps its hits), unless that replica
is out of balance: it holds `BALANCE_ABS` more outstanding sequences than the least loaded one, and
`BALANCE_REL` times as many (both, as SGLang's cache-aware router has it). Otherwise, and for short
prompts, the least loaded ready replica wins, ties going round in turn. Work is counted in sequences (a
request of n samples is n). Plain Python: no Ray, no clock; the caller serializes calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BALANCE_ABS = 16  # sequences: affinity yields only to a clear imbalance...
BALANCE_REL = 1.5  # ...in both senses
MAX_PREFIXES = 1 << 16  # first blocks remembered (least recently used forgotten first): ~10 MB at most


class Balancer:
    def __init__(self, num_replicas: int, block_size: int, max_prefixes: int = MAX_PREFIXES) -> None:
        self.block_size = block_size
        self.load = [0] * num_replicas  # outstanding sequences per replica
        self._affinity: OrderedDict[tuple[int, ...], int] = OrderedDict()  # first block -> replica
        self._max_prefixes = max_prefixes
        self._turn = 0  # where the search for the least loaded starts: ties go round

    def choose(self, prompt_token_ids: Sequence[int], ready: Sequence[bool]) -> int | None:
        """The replica for a prompt, among the ready ones (None if none is)."""
        load = self.load
        candidates = [i for i, ok in enumerate(ready) if ok]
        if not candidates:
            return None
        n = len(load)
        start = self._turn
        least = min(candidates, key=lambda i: (load[i], (i - start) % n))
        self._turn = (least + 1) % n
        if len(prompt_token_ids) < self.block_size:
            return least
        key = tuple(prompt_token_ids[: self.block_size])
        owner = self._affinity.get(key)
        if owner is not None and ready[owner] and not self._imbalanced(owner, least):
            self._affinity.move_to_end(key)
            return owner
        if owner is None or not ready[owner]:  # unseen, or its replica lost its cache: the new one holds it
            self._affinity[key] = least
            self._affinity.move_to_end(key)
            if len(self._affinity) > self._max_prefixes:
                self._affinity.popitem(last=False)
        return least

    def _imbalanced(self, owner: int, least: int) -> bool:
        busy, idle = self.load[owner], self.load[least]
        return busy - idle > BALANCE_ABS and busy > BALANCE_REL * idle

    def forget(self, replica: int) -> None:
        """`replica` lost its cache (it died): its prefixes go to whichever replica sees them next."""
        self._affinity = OrderedDict((k, r) for k, r in self._affinity.items() if r != replica)
