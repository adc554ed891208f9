"""A real uvicorn server on a free port in a background thread, for tests that talk HTTP to an app; the engine
core processes a server process started."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI


@dataclass
class RunningServer:
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What the openai client takes."""
        return f"{self.url}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(app: FastAPI, loop: str = "auto", timeout: float = 60.0) -> RunningServer:
    """Run `app` (lifespan included) in its own thread and event loop (`loop`: uvicorn's choice, "auto" takes
    uvloop as `asyncllm serve` does); returns once it accepts connections."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop=loop)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during startup (see the log above)"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return RunningServer(app, server, thread, port)


def core_processes(pid: int) -> list[int]:
    """The engine core processes (`core_process=True`) that process `pid` started (Linux /proc)."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [c for c in children if b"core_proc import main" in Path(f"/proc/{c}/cmdline").read_bytes()]
