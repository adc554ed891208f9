"""Connection hygiene for `asyncllm serve`: how long a client may take to send a request, how long an idle
connection stays open, and how many connections and requests the server holds at once.

uvicorn (0.29-0.55) bounds the idle time between requests (`timeout_keep_alive`) and the requests in flight
(`limit_concurrency`, 503 beyond it), but sets no time on reading a request: a client trickling its headers or
stalling mid-body kept its connection, and the task waiting for that body, for good (250 such connections
were all open after 20 s, issue 39). `read_deadline_protocol` adds that bound to uvicorn's own HTTP protocol:
a request's headers and body must arrive within `seconds` of its first byte (the connection's opening, for
its first request), or the connection is closed, with a 408 when nothing was answered on it yet. Responses
are not bounded: a stream runs as long as it generates. Knows nothing of the app.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

logger = logging.getLogger("asyncllm.server")

DEFAULT_READ_TIMEOUT_S = 30.0  # a request's headers and body: a 10 MB body needs only ~3 Mbit/s to make it
DEFAULT_KEEP_ALIVE_S = 5.0  # uvicorn's own default
DEFAULT_LIMIT_CONCURRENCY = 4096  # connections (and requests in flight): past it, new requests are answered 503

_TIMED_OUT = b"the request was not received in time (--timeout-request-read); the connection is closed\n"
_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: " + str(len(_TIMED_OUT)).encode() + b"\r\n\r\n" + _TIMED_OUT
)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connections (docs/server.md: Connections)")
    group.add_argument(
        "--timeout-request-read",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        metavar="SECONDS",
        help="a request's headers and body must arrive within this long of its first byte, else its connection is "
        "closed (408 when nothing was answered yet): slow or stalled senders hold nothing "
        f"(default: {DEFAULT_READ_TIMEOUT_S:g})",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=DEFAULT_KEEP_ALIVE_S,
        metavar="SECONDS",
        help=f"an idle connection between requests is closed after this long (default: {DEFAULT_KEEP_ALIVE_S:g})",
    )
    group.add_argument(
        "--limit-concurrency",
        type=int,
        default=DEFAULT_LIMIT_CONCURRENCY,
        metavar="N",
        help="most connections (and requests in flight) the server holds; a request beyond them is answered 503 "
        f"at once (default: {DEFAULT_LIMIT_CONCURRENCY})",
    )


def check_connection_arguments(args: argparse.Namespace) -> str | None:
    """The first refused value, as the message to print (None: all fine)."""
    timeouts = {"--timeout-request-read": args.timeout_request_read, "--timeout-keep-alive": args.timeout_keep_alive}
    for flag, value in timeouts.items():
        if not 0 < value < float("inf"):
            return f"{flag} {value} is invalid: give seconds > 0"
    if args.limit_concurrency < 1:
        return f"--limit-concurrency {args.limit_concurrency} is invalid: give a number of connections >= 1"
    return None


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `uvicorn.Config` the flags above set."""
    return {
        "http": read_deadline_protocol(args.timeout_request_read),
        "timeout_keep_alive": args.timeout_keep_alive,
        "limit_concurrency": args.limit_concurrency,
    }


def read_deadline_protocol(seconds: float, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (`base`: httptools' when installed, else h11's, as uvicorn picks) with a read
    deadline: each request must be received whole within `seconds` (see the module's docstring)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    parent: Any = base  # uvicorn's protocols are untyped to mypy's eyes: their attributes are read below

    class ReadDeadline(parent):  # type: ignore[misc]
        """A timer per request being read. It starts at the connection's opening and at the first byte of each
        later request (uvicorn's keep-alive timer covers the time between); it stops once the request's
        message is complete (`cycle.more_body` false on a cycle newer than the one before it)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._reading_after: object = None  # the cycle before the request being read (None: the first)

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self._deadline is None and (cycle is None or not cycle.more_body):
                self._arm()  # the first bytes of the next request
            super().data_received(data)
            cycle = self.cycle
            newer = cycle is not None and cycle is not self._reading_after
            if self._deadline is not None and newer and not cycle.more_body:
                self._disarm()  # received whole

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._reading_after = self.cycle
            self._deadline = asyncio.get_running_loop().call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            cycle = self.cycle
            answering = cycle is not None and cycle is not self._reading_after and cycle.response_started
            if not answering:
                transport.write(_408)
            logger.debug("asyncllm: closed a connection whose request was not received within %g s", seconds)
            transport.close()  # the app's task for a half-read body sees a disconnect and ends

    ReadDeadline.__name__ = f"ReadDeadline{base.__name__}"
    return ReadDeadline
