"""`Compiles`: admission's output-constraint compiles, run beside each other and bounded in time.

A request whose constraint must compile is handed here and goes on when its compile ends, in whatever order
compiles end: requests that need no compile never wait behind one, and one slow compile holds no other. At
most `workers` compile at once, each in a thread of its own. A compile not finished `timeout` seconds after
it was handed over (its wait for a thread included) fails its request at once and is abandoned: dropped if it
had not started; if it had, left to run out in its thread (a compiler cannot be interrupted), its result
ignored and its thread no longer counted, so the next compile starts. At most `workers` abandoned compiles
run at a time: past that, compiles wait for them, and hostile constraints cannot take every core.
Knows nothing of requests: jobs are opaque.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")

# Compiles running at once. xgrammar compiles without the GIL, one core each: a few keep the CPU for the rest.
COMPILE_WORKERS = 4


class Compiles(Generic[J, R]):
    """`submit(job)` from any thread: `compile(job)` (which must not raise: it returns its failure as its
    result) runs in a compile thread and `done(job, result)` follows there; or, `timeout` seconds after the
    submit, `done(job, timed_out(job))` in the watchdog thread. Each job gets exactly one `done`, called with
    no lock of this class held."""

    def __init__(
        self,
        compile: Callable[[J], R],
        done: Callable[[J, R], None],
        timed_out: Callable[[J], R],
        timeout: float,
        workers: int = COMPILE_WORKERS,
    ) -> None:
        self._compile, self._done, self._timed_out = compile, done, timed_out
        self._timeout, self._workers = timeout, workers
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._jobs: dict[int, J] = {}  # every job without its `done` yet
        self._waiting: deque[int] = deque()  # keys handed over, oldest first (those done meanwhile are skipped)
        self._started: set[int] = set()  # keys of open jobs compiling now
        self._deadlines: list[tuple[float, int]] = []  # a heap; entries of jobs done already are skipped
        self._abandoned = 0  # compiles still running whose jobs timed out
        self._stopping = False
        self._watchdog: threading.Thread | None = None

    @property
    def num_running(self) -> int:
        """Compiles whose requests wait for them."""
        with self._cond:
            return len(self._started)

    @property
    def num_abandoned(self) -> int:
        """Compiles past their timeout still running in their threads."""
        with self._cond:
            return self._abandoned

    def submit(self, job: J) -> None:
        with self._cond:
            if self._stopping:
                return  # shutting down: the engine ends every request still open
            key = next(self._ids)
            self._jobs[key] = job
            self._waiting.append(key)
            heapq.heappush(self._deadlines, (time.monotonic() + self._timeout, key))
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="asyncllm-compile-watch", daemon=True)
                self._watchdog.start()
            self._start_waiting()
            self._cond.notify_all()

    def stop(self) -> None:
        """Start nothing more and end the watchdog; compiles running finish in their (daemon) threads unheard."""
        with self._cond:
            self._stopping = True
            self._jobs.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ under the lock
    def _start_waiting(self) -> None:
        while self._waiting and len(self._started) < self._workers and self._abandoned < self._workers:
            key = self._waiting.popleft()
            job = self._jobs.get(key)
            if job is None:
                continue  # timed out while it waited
            self._started.add(key)
            threading.Thread(target=self._run, args=(key, job), name="asyncllm-compile", daemon=True).start()

    def _expire(self, now: float) -> list[J]:
        """Jobs whose deadline passed, taken out; a started one's thread counts as abandoned until it ends."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            job = self._jobs.pop(key, None)
            if job is None:
                continue  # done already
            if key in self._started:
                self._started.discard(key)
                self._abandoned += 1
            expired.append(job)
        return expired

    # ------------------------------------------------------------------ the threads
    def _run(self, key: int, job: J) -> None:
        result = self._compile(job)
        with self._cond:
            mine = self._jobs.pop(key, None) is not None  # else it timed out (or the engine stops) meanwhile
            if mine:
                self._started.discard(key)
            elif not self._stopping:
                self._abandoned -= 1
            self._start_waiting()
        if mine:
            self._done(job, result)

    def _watch(self) -> None:
        """Fail each job still open at its deadline."""
        while True:
            with self._cond:
                expired = self._expire(time.monotonic())
                while not expired and not self._stopping:
                    wait = max(0.0, self._deadlines[0][0] - time.monotonic()) if self._deadlines else None
                    self._cond.wait(wait)
                    expired = self._expire(time.monotonic())
                if self._stopping:
                    return
                self._start_waiting()
            for job in expired:
                self._done(job, self._timed_out(job))
