"""The app bounds a request body's read by itself (issue 39): mounted in a plain uvicorn (no `asyncllm serve`
protocol: uvicorn sets no read timeout), a body stalled midway gets a 408 in JSON and the connection closes
within `body_read_timeout`, on either HTTP protocol; a slow but steady body, and a stream running longer than
the bound, are served; `body_read_timeout=None` leaves the read unbounded (a server that bounds it itself)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.server.conftest import MODEL
from tests.server.serving import free_port
from tests.server.test_connections import BODY, PROTOCOLS, connect, read_response, read_until_closed, request_head

READ_S = 0.5


@contextlib.contextmanager
def plain_uvicorn(engine: AsyncLLMEngine, http: Any, body_read_timeout: float | None) -> Iterator[int]:
    """The app in a uvicorn of its own, with none of `asyncllm serve`'s connection flags; yields its port."""
    chosen = free_port()
    app = create_app(engine, served_model_name=MODEL, body_read_timeout=body_read_timeout)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=chosen, log_level="warning", http=http))
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


@pytest.fixture(scope="module", params=PROTOCOLS, ids=["httptools", "h11"])
def port(request: pytest.FixtureRequest, engine: AsyncLLMEngine) -> Iterator[int]:
    with plain_uvicorn(engine, request.param, READ_S) as chosen:
        yield chosen


def test_a_body_stalled_midway_gets_a_408_and_the_connection_closes(port: int) -> None:
    with connect(port) as sock:
        start = time.monotonic()
        sock.sendall(request_head(len(BODY)) + BODY[:10])  # then nothing
        data, _ = read_until_closed(sock)
        took = time.monotonic() - start
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "0.5 s" in error["message"]
    assert READ_S - 0.05 < took < READ_S + 1.5


def test_a_slow_steady_body_and_a_next_request_are_served(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request_head(len(BODY)))
        for piece in (BODY[:10], BODY[10:20], BODY[20:]):  # within the bound, in pieces
            time.sleep(0.1)
            sock.sendall(piece)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(READ_S + 0.2)  # idle longer than the bound between requests: not a body being read
        sock.sendall(request_head(len(BODY)) + BODY)
        assert read_response(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("http", PROTOCOLS, ids=["httptools", "h11"])
def test_a_stream_longer_than_the_bound_runs_to_its_end(engine: AsyncLLMEngine, http: Any) -> None:
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 300, "ignore_eos": true, "stream": true}' % MODEL.encode()
    with plain_uvicorn(engine, http, 0.02) as chosen, connect(chosen) as sock:  # 300 steps take far longer
        start = time.monotonic()
        sock.sendall(request_head(len(body)) + body)
        data = b""
        while b"data: [DONE]" not in data:
            chunk = sock.recv(65536)
            assert chunk, "the stream was cut"
            data += chunk
        assert time.monotonic() - start > 0.02
    assert data.startswith(b"HTTP/1.1 200") and b'"finish_reason":"length"' in data


def test_no_bound_leaves_a_stalled_body_waiting(engine: AsyncLLMEngine) -> None:
    with plain_uvicorn(engine, PROTOCOLS[1], None) as chosen, connect(chosen) as sock:
        sock.sendall(request_head(len(BODY)) + BODY[:10])
        sock.settimeout(READ_S + 0.5)
        with pytest.raises(socket.timeout):
            sock.recv(65536)  # nothing answered, nothing closed
    with pytest.raises(ValueError, match="body_read_timeout must be seconds > 0"):
        create_app(engine, served_model_name=MODEL, body_read_timeout=0)
