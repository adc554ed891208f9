"""A c10d store for one group's symmetric-memory rendezvous whose exchange numbers start at 0 on every rank.

torch's CUDA symmetric memory exchanges handles through the group's store under keys `<kind>/<n>/<rank>`, where
n counts that kind of exchange in the whole process (one static counter in C++). A tensor-parallel worker is a
fresh process (n starts at 0) while the engine's process may have set up earlier engines (n is further on), so
rank 0 would wait for keys its peers never write. This store renumbers each kind from the first n it sees:
every rank's k-th exchange of this group meets under the same key. Other keys pass through unchanged. It
knows nothing of GPUs; C++ calls it through torch's Python-store trampoline (set-up only, never per step).
"""

from __future__ import annotations

import threading
from datetime import timedelta

from torch._C._distributed_c10d import Store


class SequenceAlignedStore(Store):
    def __init__(self, inner: Store, timeout: timedelta) -> None:
        super().__init__()
        self._inner = inner
        self._timeout = timeout  # the longest any wait may take: a mismatched peer fails set-up, never hangs it
        self._bases: dict[str, int] = {}  # exchange kind -> the first number seen
        self._lock = threading.Lock()

    def aligned(self, key: str) -> str:
        """`<kind>/<n>/<rank>` -> `<kind>/<n - first n of kind>/<rank>`; any other key unchanged. The kind is
        everything before the last two parts, so a prefix torch might add in front keeps working."""
        parts = key.rsplit("/", 2)
        if len(parts) != 3 or not parts[0] or parts[0].isdigit() or not (parts[1].isdigit() and parts[2].isdigit()):
            return key
        kind, number = parts[0], int(parts[1])
        with self._lock:
            base = self._bases.setdefault(kind, number)
        return f"{kind}/{number - base}/{parts[2]}"

    def set(self, key: str, value: str) -> None:  # C++ passes bytes; the stubs say str
        self._inner.set(self.aligned(key), value)

    def get(self, key: str) -> bytes:
        return self._inner.get(self.aligned(key))

    def add(self, key: str, value: int) -> int:
        return self._inner.add(self.aligned(key), value)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check([self.aligned(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout if timeout is None else min(timeout, self._timeout)
        self._inner.wait([self.aligned(k) for k in keys], limit)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return self._inner.compare_set(self.aligned(key), expected_value, desired_value)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self.aligned(key))

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._inner.multi_get([self.aligned(k) for k in keys])
