"""Waiting for a ring end: a short spin (`Spinner`), then sleep on a datagram socket (`WakeSocket`).

Each end binds its own address in Linux's abstract socket namespace (`\\0<ring name>-r<rank>` for a reader,
`\\0<ring name>-w` for the writer), blocks in poll() on it when it has nothing to do, and pokes another end by
sending it one byte. Addresses derive from the ring's name, so nothing is passed at spawn time and nothing is
left to clean up (an abstract socket vanishes with its last descriptor, even when its process is killed).
Knows nothing of the ring's memory or protocol.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import time
from collections.abc import Callable

_SLOW_YIELD_S = 50e-6  # a yield that took this long let another process run: this core is contended
_QUIET_S = 0.1  # then sleep at once for this long: a woken sleeper gets the core back fast, a yielder a slice late


def reader_address(ring_name: str, rank: int) -> str:
    return f"\0{ring_name}-r{rank}"


def writer_address(ring_name: str) -> str:
    return f"\0{ring_name}-w"


class AddressInUseError(OSError):
    """Another live socket holds this address: that end of the ring is already open."""


class WakeSocket:
    """One end's socket: bound to its own address (so it can be woken) and able to wake any other end."""

    def __init__(self, address: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(address)
        except OSError as exc:
            self._sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUseError(exc.errno, f"{exc.strerror}: {address[1:]}") from exc
            raise
        self._sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)

    def wake(self, address: str) -> bool:
        """Poke the end bound at `address`; False if nobody is bound there (not attached yet, closed, or its
        process is gone: the kernel closes a dead process's sockets), whatever namespace its pid lives in."""
        try:
            self._sock.sendto(b"\1", address)
        except ConnectionRefusedError:
            return False
        except BlockingIOError:
            pass  # its queue is full of earlier pokes: it is there, and will wake anyway
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until a wake-up arrives or `timeout_s` passes, then discard every queued wake-up: the caller
        re-checks the ring after this returns, so pokes that arrived meanwhile carry no news."""
        if self._poll.poll(max(1, math.ceil(timeout_s * 1000))):
            while True:
                try:
                    self._sock.recv(64)
                except BlockingIOError:
                    return

    def close(self) -> None:
        self._sock.close()


class Spinner:
    """Polls a condition for up to `spin_s`, yielding the core between polls (a writer or reader sharing it gets
    to run). Once a yield shows other processes competing for the core, it stops spinning for a while."""

    def __init__(self, spin_s: float) -> None:
        self._spin_s = spin_s
        self._quiet_until = 0.0

    def spin(self, ready: Callable[[], bool]) -> bool:
        """True as soon as `ready()` is; False after `spin_s` (or at once while the core is contended)."""
        now = time.monotonic()
        if now < self._quiet_until:
            return False
        end = now + self._spin_s
        while now < end:
            os.sched_yield()
            after = time.monotonic()
            if ready():
                return True
            if after - now > _SLOW_YIELD_S:
                self._quiet_until = after + _QUIET_S
                return False
            now = after
        return False
