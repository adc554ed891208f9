"""The scheduler's waiting queue: requests not running, in the order they are admitted.

By priority first (lower runs first, vLLM's convention), then first come, first served; a preempted request
goes back before every request of its priority that arrived after it. One deque per priority present, so
requests that all share one priority (the default) cost what one deque costs. Plain Python; knows nothing
of blocks or steps.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from asyncllm.core.request import Request


class WaitingQueue:
    """`append` a new request (last of its priority), `appendleft` a preempted one (back at its arrival
    place), `peek`/`popleft` the first, `remove` any."""

    def __init__(self) -> None:
        self._levels: dict[int, deque[Request]] = {}
        self._priorities: list[int] = []  # the keys of `_levels`, sorted: the first is served first
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        for priority in self._priorities:
            yield from self._levels[priority]

    def append(self, request: Request) -> None:
        """A request just added: after every waiting request of its priority."""
        self._level(request.priority).append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request: before every waiting request of its priority that arrived after it (the
        head of its priority, in practice: within a priority, requests start in arrival order)."""
        level = self._level(request.priority)
        if not level or request.arrival_index <= level[0].arrival_index:
            level.appendleft(request)
        else:  # several preempted at once, out of arrival order
            at = bisect.bisect_right([r.arrival_index for r in level], request.arrival_index)
            level.insert(at, request)
        self._len += 1

    def peek(self) -> Request:
        """The request admitted next (the queue must not be empty)."""
        return self._levels[self._priorities[0]][0]

    def popleft(self) -> Request:
        priority = self._priorities[0]
        level = self._levels[priority]
        request = level.popleft()
        if not level:
            self._drop(priority)
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        """Take `request` out wherever it waits (an abort); ValueError if it is not here."""
        level = self._levels.get(request.priority)
        if level is None:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        level.remove(request)
        if not level:
            self._drop(request.priority)
        self._len -= 1

    def _level(self, priority: int) -> deque[Request]:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = deque()
            bisect.insort(self._priorities, priority)
        return level

    def _drop(self, priority: int) -> None:
        del self._levels[priority]
        self._priorities.remove(priority)
