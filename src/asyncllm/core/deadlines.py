"""`Deadlines`: the live requests' deadlines (`add_request(..., timeout=)`) in a heap, so each step asks only
for the ones that are due. Knows ids and times; whether a due id is still live is the engine core's call.
"""

from __future__ import annotations

import heapq


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []  # (deadline, arrival order, request id)
        self._count = 0

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request_id: str, deadline: float) -> None:
        self._count += 1
        heapq.heappush(self._heap, (deadline, self._count, request_id))

    def due(self, now: float) -> list[str]:
        """The ids whose deadline is `now` or earlier, earliest first, forgotten here once returned (ids of
        requests that finished meanwhile included: the caller skips those)."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap)[2])
        return out
