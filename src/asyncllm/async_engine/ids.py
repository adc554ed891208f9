"""Request ids and the registry of live requests: which ids are in use and which output slot each feeds.

The registry is the one place that decides "live": a caller may not reuse an id until the step thread has
routed that request's final output, and once the engine is dead or shut down nothing new is admitted. It
also counts the live requests that have not started (`max_waiting`: beyond it a request is refused at once,
exactly, whichever thread adds it while the step thread starts others) and stops admitting for a drain.
Thread-safe (callers' threads register, the step thread routes); knows nothing of the engine core.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from asyncllm.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from asyncllm.validation import short_repr

T = TypeVar("T")


class _RandomIds:
    """128 random bits per id from a generator seeded once from the OS: uuid4 reads os.urandom every call,
    a system call per id, and hundreds of requests may arrive at once on one loop tick."""

    def __init__(self) -> None:
        self._rng: random.Random | None = None

    def __call__(self) -> str:
        rng = self._rng
        if rng is None:
            rng = self._rng = random.Random(uuid.uuid4().int)
        return f"{rng.getrandbits(128):032x}"  # getrandbits is one C call under the GIL: thread-safe


new_request_id = _RandomIds()
new_request_id.__doc__ = "A fresh id for a caller that gave none: random, so ids never repeat across engines."


def check_request_id(request_id: object, *, optional: bool = True) -> str:
    """`request_id` if it is a non-empty str; `InvalidRequestError` naming the argument otherwise (a list
    reached a dict lookup and raised "unhashable type")."""
    if not isinstance(request_id, str) or request_id == "":
        allowed = "a non-empty str, or None" if optional else "a non-empty str"
        raise InvalidRequestError(f"request_id={short_repr(request_id)} is invalid: give {allowed}")
    return request_id


class LiveRequests(Generic[T]):
    """request id -> its output slot, for every request admitted and not yet finished; and which of them
    wait to start. `max_waiting`: None (unbounded) or at least 1."""

    def __init__(self, max_waiting: int | None = None) -> None:
        self._lock = threading.Lock()
        self._emptied = threading.Condition(self._lock)  # notified when the last live request leaves
        self._live: dict[str, T] = {}
        self._waiting: set[T] = set()  # registered and not started (see `started`)
        self.max_waiting = max_waiting
        self.num_rejected = 0  # registrations refused for max_waiting
        self._closed: Callable[[], EngineDeadError] | None = None  # set once: makes the error to raise
        self._refusing: Callable[[], EngineDeadError] | None = None  # set once by a drain: the same, softer

    def register(self, request_id: str, slot: T) -> None:
        """Admit one request, or raise at once: `EngineDeadError` when closed or draining,
        `InvalidRequestError` on a duplicate live id, `EngineOverloadedError` when `max_waiting` requests
        wait to start. Checked under one lock, so no request slips in after `close` swept the rest, and the
        count is exact: the (max_waiting + 1)th is refused, and one more is taken as soon as one starts."""
        with self._lock:
            refuse = self._closed or self._refusing
            if refuse is not None:
                raise refuse()
            if request_id in self._live:
                raise InvalidRequestError(
                    f"request_id={request_id!r} is already live: wait for it to finish or give another id"
                )
            limit = self.max_waiting
            if limit is not None and len(self._waiting) >= limit:
                self.num_rejected += 1
                raise EngineOverloadedError(
                    f"the engine is overloaded: {len(self._waiting)} requests already wait to start "
                    f"(max_waiting_requests={limit}); retry later"
                )
            self._live[request_id] = slot
            self._waiting.add(slot)

    def started(self, request_ids: Iterable[str]) -> None:
        """These requests' prompts started computing: they no longer count as waiting (a later preemption
        does not count them again). Ids no longer live are skipped."""
        with self._lock:
            for rid in request_ids:
                slot = self._live.get(rid)
                if slot is not None:
                    self._waiting.discard(slot)

    def stop_admitting(self, make_error: Callable[[], EngineDeadError]) -> None:
        """Refuse every later `register` with `make_error()` (a drain); live requests carry on."""
        with self._lock:
            if self._refusing is None:
                self._refusing = make_error

    @property
    def admitting(self) -> bool:
        return self._closed is None and self._refusing is None

    def wait_empty(self, timeout: float | None) -> bool:
        """Block until no request is live (True), or `timeout` seconds passed (False)."""
        with self._emptied:
            return self._emptied.wait_for(lambda: not self._live, timeout)

    def slots(self) -> list[T]:
        """The live requests' slots, a snapshot."""
        with self._lock:
            return list(self._live.values())

    @property
    def num_waiting(self) -> int:
        """Live requests not started yet: what `max_waiting` bounds."""
        return len(self._waiting)

    def get(self, request_id: str) -> T | None:
        return self._live.get(request_id)  # a single dict read is atomic; no lock needed

    def resolve(self, request_ids: list[str], finished: list[bool]) -> list[T | None]:
        """Slots for one step's outputs (None for ids no longer live); ids whose output is final leave."""
        with self._lock:
            slots = [self._live.get(rid) for rid in request_ids]
            for rid, slot, done in zip(request_ids, slots, finished):
                if done and slot is not None:
                    del self._live[rid]
                    self._waiting.discard(slot)
            if not self._live:
                self._emptied.notify_all()
        return slots

    def close(self, make_error: Callable[[], EngineDeadError]) -> list[T]:
        """Refuse every later `register` with `make_error()`; returns the slots that were still live."""
        with self._lock:
            if self._closed is None:
                self._closed = make_error
            slots = list(self._live.values())
            self._live.clear()
            self._waiting.clear()
            self._emptied.notify_all()
        return slots

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def closed_error(self) -> EngineDeadError | None:
        make = self._closed
        return None if make is None else make()

    def __len__(self) -> int:
        return len(self._live)
