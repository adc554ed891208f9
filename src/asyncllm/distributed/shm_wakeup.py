"""Wake-ups for a ring end that sleeps: one datagram socket per end in Linux's abstract socket namespace.

Each end binds its own address (`\\0<ring name>-r<rank>` for a reader, `\\0<ring name>-w` for the writer), blocks
in poll() on it when it has nothing to do, and pokes another end by sending it one byte. Addresses derive from
the ring's name, so nothing is passed at spawn time and nothing is left to clean up (an abstract socket vanishes
with its last descriptor, even when its process is killed). Knows nothing of the ring itself.
"""

from __future__ import annotations

import errno
import math
import select
import socket


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
