"""Request ids and the registry of live requests: which ids are in use and which output slot each feeds.

The registry is the one place that decides "live": a caller may not reuse an id until the step thread has
routed that request's final output, and once the engine is dead or shut down nothing new is admitted.
Thread-safe (callers' threads register, the step thread routes); knows nothing of the engine core.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable
from typing import Generic, TypeVar

from asyncllm.errors import EngineDeadError, InvalidRequestError
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
    """request id -> its output slot, for every request admitted and not yet finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, T] = {}
        self._closed: Callable[[], EngineDeadError] | None = None  # set once: makes the error to raise

    def register(self, request_id: str, slot: T) -> None:
        """Admit one request, or raise at once: `EngineDeadError` when closed, `InvalidRequestError` on a
        duplicate live id. Checked under one lock, so no request slips in after `close` swept the rest."""
        with self._lock:
            if self._closed is not None:
                raise self._closed()
            if request_id in self._live:
                raise InvalidRequestError(
                    f"request_id={request_id!r} is already live: wait for it to finish or give another id"
                )
            self._live[request_id] = slot

    def get(self, request_id: str) -> T | None:
        return self._live.get(request_id)  # a single dict read is atomic; no lock needed

    def resolve(self, request_ids: list[str], finished: list[bool]) -> list[T | None]:
        """Slots for one step's outputs (None for ids no longer live); ids whose output is final leave."""
        with self._lock:
            slots = [self._live.get(rid) for rid in request_ids]
            for rid, done in zip(request_ids, finished):
                if done:
                    self._live.pop(rid, None)
        return slots

    def close(self, make_error: Callable[[], EngineDeadError]) -> list[T]:
        """Refuse every later `register` with `make_error()`; returns the slots that were still live."""
        with self._lock:
            if self._closed is None:
                self._closed = make_error
            slots = list(self._live.values())
            self._live.clear()
        return slots

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def closed_error(self) -> EngineDeadError | None:
        make = self._closed
        return None if make is None else make()

    def __len__(self) -> int:
        return len(self._live)
