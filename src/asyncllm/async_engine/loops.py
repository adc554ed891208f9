"""The two things the async layer needs from an event loop, for asyncio (uvloop included) and trio.

A thread-safe "call this soon on that loop" (how the step thread wakes consumers) and a waiter a consumer
awaits until woken. `current_loop_key()` finds the caller's loop: asyncio's running loop, else trio's token
when trio is loaded (no sniffio: newer anyio no longer brings it). Knows nothing of requests or streams;
trio is imported only when a trio program calls in.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Hashable
from typing import Any


class EventLoop:
    """One running loop, as the async layer uses it. `key` identifies the loop (one mailbox per key)."""

    key: Hashable
    is_asyncio: bool

    def call_soon_threadsafe(self, callback: Callable[[], object]) -> None:
        """Any thread: run `callback` on the loop soon. Raises RuntimeError once the loop is closed."""
        raise NotImplementedError

    def new_waiter(self) -> Any:
        """On the loop: a fresh one-shot waiter, for `wait` and `wake`."""
        raise NotImplementedError

    def wait(self, waiter: Any) -> Awaitable[object]:
        """On the loop: what the consumer awaits until `wake(waiter)` (cancellation raises through it). It
        returns the value `wake` handed over where `can_hand_over` said it would, else None."""
        raise NotImplementedError

    def can_hand_over(self, waiter: Any) -> bool:
        """On the loop: whether `wake(waiter, value)` would deliver `value` now (the waiter carries values
        and nobody woke it yet); when False the woken consumer fetches what it needs itself."""
        raise NotImplementedError

    def wake(self, waiter: Any, value: object = None) -> None:
        """On the loop: resume whoever waits on `waiter`, handing `value` over (see `can_hand_over`);
        idempotent: a second wake changes nothing."""
        raise NotImplementedError

    def is_current(self) -> bool:
        """Whether the calling code runs on this loop."""
        raise NotImplementedError


class AsyncioLoop(EventLoop):
    """asyncio and uvloop: a future per wait, `loop.call_soon_threadsafe` to reach the loop."""

    is_asyncio = True

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.key = loop

    def call_soon_threadsafe(self, callback: Callable[[], object]) -> None:
        self.loop.call_soon_threadsafe(callback)

    def new_waiter(self) -> asyncio.Future[object]:
        return self.loop.create_future()

    def wait(self, waiter: asyncio.Future[object]) -> Awaitable[object]:
        return waiter  # a future is awaitable itself: no coroutine frame per wait

    def can_hand_over(self, waiter: asyncio.Future[object]) -> bool:
        return not waiter.done()  # a future's result is the value; a done one (woken, cancelled) takes none

    def wake(self, waiter: asyncio.Future[object], value: object = None) -> None:
        if not waiter.done():
            waiter.set_result(value)

    def is_current(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False


class TrioLoop(EventLoop):
    """trio: a `trio.Event` per wait, the run's `TrioToken.run_sync_soon` to reach it."""

    is_asyncio = False

    def __init__(self, token: Any) -> None:
        import trio

        self._trio = trio
        self._token = token
        self.key = token

    def call_soon_threadsafe(self, callback: Callable[[], object]) -> None:
        self._token.run_sync_soon(callback)  # trio.RunFinishedError (a RuntimeError) once the run is over

    def new_waiter(self) -> Any:
        return self._trio.Event()

    def wait(self, waiter: Any) -> Awaitable[object]:
        return waiter.wait()  # type: ignore[no-any-return]

    def can_hand_over(self, waiter: Any) -> bool:
        return False  # a trio.Event only says it was set

    def wake(self, waiter: Any, value: object = None) -> None:
        waiter.set()

    def is_current(self) -> bool:
        try:
            return self._trio.lowlevel.current_trio_token() is self.key
        except RuntimeError:
            return False


def current_loop_key() -> tuple[str, Hashable]:
    """(library, key) of the caller's running loop; RuntimeError when there is none."""
    library = _running_library()
    if library == "asyncio":
        return library, asyncio.get_running_loop()
    if library == "trio":
        import trio

        return library, trio.lowlevel.current_trio_token()
    raise RuntimeError(
        "add_request needs a running event loop (asyncio, uvloop or trio): call it from a coroutine; the "
        "stream is bound to that loop (found none)"
    )


def _running_library() -> str | None:
    """ "asyncio" (uvloop included) or "trio" for the loop running in this thread, None without one."""
    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")  # a trio program has imported it; never import it just to look
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return "trio"
        except RuntimeError:
            pass
    return None


def make_loop(library: str, key: Hashable) -> EventLoop:
    return AsyncioLoop(key) if library == "asyncio" else TrioLoop(key)  # type: ignore[arg-type]


async def run_in_thread(fn: Callable[[], object]) -> None:
    """Run a blocking `fn` in a worker thread without blocking the caller's loop, whichever it is."""
    if _running_library() == "trio":
        import trio

        await trio.to_thread.run_sync(fn)
    else:
        await asyncio.to_thread(fn)
