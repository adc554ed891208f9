"""Connection hygiene (issue 39, finding 5): a client trickling its headers or stalling mid-body loses its
connection after `--timeout-request-read` (a 408 when nothing was answered), on either of uvicorn's HTTP
protocols; a slow but steady request, an idle keep-alive connection between requests and a long streamed
response are untouched; the flags reach uvicorn and refuse bad values in one line."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from asyncllm import AsyncLLMEngine
from asyncllm.console import EXIT_USAGE
from asyncllm.server import create_app
from asyncllm.server.cli import build_parser, main
from asyncllm.server.connections import read_deadline_protocol, uvicorn_options
from tests.server.conftest import MODEL
from tests.server.serving import free_port

READ_S = 0.5
KEEP_ALIVE_S = 1.5
BODY = b'{"model": "%s", "prompt": "Hi", "max_tokens": 2}' % MODEL.encode()


@contextlib.contextmanager
def serving(engine: AsyncLLMEngine, base: type[asyncio.Protocol], read_s: float) -> Iterator[int]:
    """A server on the shared engine whose requests must arrive within `read_s` seconds; yields its port."""
    chosen = free_port()
    config = uvicorn.Config(
        create_app(engine, served_model_name=MODEL),
        host="127.0.0.1",
        port=chosen,
        log_level="warning",
        http=read_deadline_protocol(read_s, base),
        timeout_keep_alive=KEEP_ALIVE_S,  # type: ignore[arg-type]  # uvicorn's annotation says int; it takes seconds
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield chosen
    finally:
        server.should_exit = True
        thread.join(30)


PROTOCOLS = [HttpToolsProtocol, H11Protocol]


@pytest.fixture(scope="module", params=PROTOCOLS, ids=["httptools", "h11"])
def port(request: pytest.FixtureRequest, engine: AsyncLLMEngine) -> Iterator[int]:
    with serving(engine, request.param, READ_S) as chosen:
        yield chosen


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (seconds from the call)."""
    start = time.monotonic()
    sock.settimeout(timeout)
    chunks = []
    while True:
        data = sock.recv(65536)
        if not data:
            return b"".join(chunks), time.monotonic() - start
        chunks.append(data)


def request_head(length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % length
    )


def read_response(sock: socket.socket) -> bytes:
    """One response with a content-length, read whole (the connection stays open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_trickled_headers_lose_the_connection(port: int) -> None:
    with connect(port) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        try:
            for _ in range(40):  # a byte every 50 ms: never a whole head
                time.sleep(0.05)
                sock.sendall(b"x")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = read_until_closed(sock)
        assert time.monotonic() - start < READ_S + 1.5
    assert data == b"" or data.startswith(b"HTTP/1.1 408"), data[:200]


def test_a_body_stalled_midway_gets_a_408_and_the_connection_closes(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request_head(len(BODY)) + BODY[:10])  # then nothing
        data, after = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"--timeout-request-read" in data and after < READ_S + 1.5


def test_a_slow_steady_request_and_a_keep_alive_connection_are_served(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request_head(len(BODY)))
        for piece in (BODY[:10], BODY[10:20], BODY[20:]):  # within the deadline, in pieces
            time.sleep(0.1)
            sock.sendall(piece)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(READ_S + 0.3)  # idle longer than the read deadline, shorter than keep-alive: still open
        sock.sendall(request_head(len(BODY)) + BODY)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        _, after = read_until_closed(sock)  # idle past keep-alive: closed by uvicorn
        assert after < KEEP_ALIVE_S + 1.5


@pytest.mark.parametrize("base", PROTOCOLS, ids=["httptools", "h11"])
def test_a_stream_longer_than_the_read_deadline_runs_to_its_end(engine: AsyncLLMEngine, base: Any) -> None:
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 300, "ignore_eos": true, "stream": true}' % MODEL.encode()
    with serving(engine, base, read_s=0.02) as port, connect(port) as sock:  # 300 steps take far longer
        start = time.monotonic()
        sock.sendall(request_head(len(body)) + body)
        data = b""
        while b"data: [DONE]" not in data:
            chunk = sock.recv(65536)
            assert chunk, "the stream was cut"
            data += chunk
        assert time.monotonic() - start > 0.02
    assert data.startswith(b"HTTP/1.1 200") and b'"finish_reason":"length"' in data


def test_flags_reach_uvicorn_and_bad_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["m", "--timeout-request-read", "7", "--timeout-keep-alive", "3"])
    options: dict[str, Any] = uvicorn_options(args)
    assert options["timeout_keep_alive"] == 3.0 and options["limit_concurrency"] == 4096
    assert issubclass(options["http"], (HttpToolsProtocol, H11Protocol))  # uvicorn's own, with the deadline
    defaults = build_parser().parse_args(["m"])
    assert (defaults.timeout_request_read, defaults.timeout_keep_alive) == (30.0, 5.0)
    for flag, value in (("--timeout-request-read", "0"), ("--timeout-keep-alive", "nan"), ("--limit-concurrency", "0")):
        assert main(["m", flag, value]) == EXIT_USAGE
        assert f"{flag} " in capsys.readouterr().err
