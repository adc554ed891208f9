"""Wake-ups for ring readers that sleep: one datagram socket per reader in Linux's abstract namespace.

A reader binds `\\0<ring name>-r<rank>` and blocks in poll() on it; the writer sends it one byte. Addresses derive
from the ring's name, so nothing has to be passed at spawn time and nothing is left to clean up (an abstract
socket disappears with its last descriptor, even when its process is killed). Knows nothing of the ring itself.
"""

from __future__ import annotations

import contextlib
import errno
import math
import select
import socket


def wake_address(ring_name: str, rank: int) -> str:
    return f"\0{ring_name}-r{rank}"


class WakeSender:
    """The writer's side: one unbound, non-blocking socket that can poke any reader."""

    def __init__(self, addresses: list[str]) -> None:
        self._addresses = addresses
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def wake(self, rank: int) -> None:
        # Refused: nobody bound there (not attached yet, or gone); would block: a wake-up is already queued.
        with contextlib.suppress(ConnectionRefusedError, BlockingIOError):
            self._sock.sendto(b"\1", self._addresses[rank])

    def close(self) -> None:
        self._sock.close()


class AddressInUseError(OSError):
    """Another live socket holds this reader's address: its rank is already attached."""


class WakeReceiver:
    """A reader's side: bound to its address; `wait` blocks until poked or until the timeout."""

    def __init__(self, address: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(address)
        except OSError as exc:
            self._sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUseError(exc.errno, exc.strerror) from exc
            raise
        self._sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)

    def wait(self, timeout_s: float) -> None:
        """Block until a wake-up arrives or `timeout_s` passes, then discard every queued wake-up: the caller
        re-checks the ring after this returns, so pokes that arrived meanwhile carry no news."""
        if self._poll.poll(max(1, math.ceil(timeout_s * 1000))):
            self.drain()

    def drain(self) -> None:
        while True:
            try:
                self._sock.recv(64)
            except BlockingIOError:
                return

    def close(self) -> None:
        self._sock.close()
