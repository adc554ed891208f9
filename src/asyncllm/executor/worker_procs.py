"""The worker processes of one tensor-parallel engine: starting them, their start-up handshake, noticing
one die, and ending them all.

Each worker is a fresh interpreter (`python -c ...`, never a fork, and never a re-import of the caller's
main module, so scripts need no `if __name__ == "__main__"` guard). It gets two pipes: one that brings its
`WorkerSpec` and then stays open, whose closing ends the worker at once (no worker outlives the engine's
process); and one it reports on: "attached", "ready", or its failure, then end-of-file when it exits. A
monitor thread reads every report: the first exit nobody asked for marks the group dead and calls
`on_death`, and the executor then fails the step in flight and every later one. Knows nothing of what the
workers compute.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from asyncllm.errors import AsyncLLMError
from asyncllm.executor.worker_main import FAILED, WorkerSpec

logger = logging.getLogger(__name__)

_ENTRY = "from asyncllm.executor.worker_main import main; main()"


class WorkerDiedError(AsyncLLMError, RuntimeError):
    """A tensor-parallel worker process exited, failed or did not start: the engine cannot go on."""


class WorkerProcesses:
    def __init__(self, specs: list[WorkerSpec]) -> None:
        self.ranks = [spec.rank for spec in specs]
        self.procs: list[subprocess.Popen[bytes]] = []
        self._to_worker: list[Connection] = []  # the spec, then silence; closing it ends that worker at once
        self._reports: list[Connection] = []
        self._last: list[tuple[str, str]] = [("", "") for _ in specs]  # each worker's latest report
        self._cond = threading.Condition()
        self.dead: str | None = None  # why the group is dead: the first worker exit nobody asked for
        self.on_death: Callable[[], None] | None = None
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()  # wakes the monitor at shutdown
        env = dict(os.environ)
        # The child finds asyncllm (and anything else) where this process does.
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        try:
            for spec in specs:
                spec_r, spec_w = os.pipe()
                report_r, report_w = os.pipe()
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", _ENTRY, str(spec_r), str(report_w)], pass_fds=(spec_r, report_w), env=env
                    )
                finally:
                    os.close(spec_r)  # only the child holds these ends now: their closing means what it should
                    os.close(report_w)
                self.procs.append(proc)
                to_worker = Connection(spec_w, readable=False)
                self._to_worker.append(to_worker)
                self._reports.append(Connection(report_r, writable=False))
                to_worker.send(spec)
        except BaseException:
            self.stop(0.0)
            raise
        self._monitor = threading.Thread(target=self._watch, name="asyncllm-tp-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        """Raise WorkerDiedError once a worker has died."""
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def wait_for(self, kind: str, timeout_s: float) -> None:
        """Block until every worker has reported `kind`; WorkerDiedError if one fails, exits or is late."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self.dead is not None or all(k == kind for k, _ in self._last), timeout_s
            )
        self.check()
        if not done:
            late = [rank for rank, (k, _) in zip(self.ranks, self._last) if k != kind]
            raise WorkerDiedError(f"tensor-parallel workers {late} did not report {kind!r} within {timeout_s} s")

    def failure(self, grace_s: float = 1.0) -> WorkerDiedError | None:
        """After a collective failed: the worker death behind it (waiting up to `grace_s` for it to show), or
        None if every worker is alive (the failure was this rank's own)."""
        with self._cond:
            self._cond.wait_for(lambda: self.dead is not None, grace_s)
        return None if self.dead is None else WorkerDiedError(self.dead)

    def expect_exit(self) -> None:
        """From now on the workers exit because they were asked to (the ring is about to close): no death."""
        with self._cond:
            self._stopping = True

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the workers to exit (they leave their loops once the ring closes), kill
        any left, and close every pipe. Idempotent."""
        self.expect_exit()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"\0")
            if hasattr(self, "_monitor"):
                self._monitor.join(5.0)
            os.close(self._wake_w)
            os.close(self._wake_r)
            self._wake_w = self._wake_r = -1
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker (pid %s) did not exit: killing it", proc.pid)
                proc.kill()
                proc.wait()
        for conn in self._to_worker + self._reports:
            conn.close()
        self._to_worker, self._reports = [], []

    def _watch(self) -> None:
        open_reports = dict(enumerate(self._reports))
        while open_reports:
            ready = wait([*open_reports.values(), self._wake_r])
            if self._wake_r in ready:
                return  # stopping: exits from now on were asked for
            for i, conn in list(open_reports.items()):
                if conn not in ready:
                    continue
                try:
                    report = conn.recv()
                except (EOFError, OSError):
                    del open_reports[i]
                    self._exited(i)
                    continue
                with self._cond:
                    self._last[i] = report
                    self._cond.notify_all()

    def _exited(self, i: int) -> None:
        with self._cond:
            if self._stopping or self.dead is not None:
                return
            self.dead = self._describe(i)
            self._cond.notify_all()
        logger.error("%s: the engine is dead", self.dead)
        callback = self.on_death
        if callback is not None:
            try:
                callback()
            except Exception:
                logger.exception("unblocking rank 0's collectives after a worker died failed")

    def _describe(self, i: int) -> str:
        proc = self.procs[i]
        try:
            code: int | None = proc.wait(1.0)  # its report pipe closed: it exits now, if not already
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "closed its report pipe"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        kind, detail = self._last[i]
        tail = f":\n{detail}" if kind == FAILED and detail else ""
        return f"tensor-parallel worker rank {self.ranks[i]} (pid {proc.pid}) {how}{tail}"
