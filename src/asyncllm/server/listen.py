"""Where `asyncllm serve` listens: the address bound before the engine loads (a busy port fails at once),
and uvicorn's server on that socket, reporting when it accepts connections. Knows nothing of the app.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not listening yet (uvicorn listens on it once the engine is up): an
    address in use raises OSError now. SO_REUSEADDR as uvicorn sets it: a port left in TIME_WAIT by the last
    server is reusable, one that another server listens on is not."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


class Server(uvicorn.Server):
    """uvicorn's server, calling `on_started` once it accepts connections (given sockets, uvicorn logs no
    address itself)."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()
