"""Which replica takes a request: least outstanding work, with prefix affinity.

A prompt's full KV blocks are named by chained hashes (as the prefix cache names them: each block's with
all before it). The balancer remembers, per named prefix, which replicas were sent a prompt starting with
it; a request goes to the least loaded of the replicas holding its deepest remembered prefix (from one
block: requests sharing a first full block meet where it is cached; a conversation's next turn goes where
its history is), unless that replica is out of balance: `BALANCE_ABS` more outstanding sequences than the
least loaded replica, and `BALANCE_REL` times as many (both, as SGLang's cache-aware router has it). Then,
and for prompts no replica holds, the least loaded ready replica wins, ties going round in turn. Work is
counted in sequences (a request of n samples is n). Plain Python: no Ray, no clock; the caller serializes
calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BALANCE_ABS = 16  # sequences: affinity yields only to a clear imbalance...
BALANCE_REL = 1.5  # ...in both senses
MAX_BLOCKS = 64  # blocks of a prompt that are named (deeper ones share their routing with these)
MAX_PREFIXES = 1 << 18  # named prefixes remembered (least recently used forgotten first): ~40 MB at most


class Balancer:
    def __init__(self, num_replicas: int, block_size: int, max_prefixes: int = MAX_PREFIXES) -> None:
        self.block_size = block_size
        self.load = [0] * num_replicas  # outstanding sequences per replica
        self._holders: OrderedDict[int, int] = OrderedDict()  # prefix hash -> bitmask of replicas sent it
        self._max_prefixes = max_prefixes
        self._turn = 0  # where the search for the least loaded starts: ties go round

    def choose(self, prompt_token_ids: Sequence[int], ready: Sequence[bool]) -> int | None:
        """The replica for a prompt, among the ready ones (None if none is); remembers the choice."""
        ready_mask = sum(1 << i for i, ok in enumerate(ready) if ok)
        if not ready_mask:
            return None
        least = self._least(ready_mask)
        keys = self._prefix_keys(prompt_token_ids)
        holders = 0
        for key in keys:  # the deepest remembered prefix's holders (each deeper one is held by fewer)
            held = self._holders.get(key, 0) & ready_mask
            if not held:
                break
            holders = held
        choice = least
        if holders:
            best = self._least(holders)
            if not self._imbalanced(best, least):
                choice = best
        self._turn = (choice + 1) % len(self.load)
        self._remember(keys, choice)
        return choice

    def forget(self, replica: int) -> None:
        """`replica` lost its cache (it died): it holds no prefix any more."""
        bit = 1 << replica
        self._holders = OrderedDict((k, m & ~bit) for k, m in self._holders.items() if m & ~bit)

    def _least(self, mask: int) -> int:
        load, n, start = self.load, len(self.load), self._turn
        return min((i for i in range(n) if mask >> i & 1), key=lambda i: (load[i], (i - start) % n))

    def _imbalanced(self, busy: int, idle: int) -> bool:
        a, b = self.load[busy], self.load[idle]
        return a - b > BALANCE_ABS and a > BALANCE_REL * b

    def _prefix_keys(self, ids: Sequence[int]) -> list[int]:
        bs = self.block_size
        keys, h = [], 0
        for start in range(0, min(len(ids) // bs, MAX_BLOCKS) * bs, bs):
            h = hash((h, *ids[start : start + bs]))
            keys.append(h)
        return keys

    def _remember(self, keys: list[int], replica: int) -> None:
        holders, bit = self._holders, 1 << replica
        for key in keys:
            holders[key] = holders.get(key, 0) | bit
            holders.move_to_end(key)
        while len(holders) > self._max_prefixes:
            holders.popitem(last=False)
