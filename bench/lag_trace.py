"""Where the event loop stalls: a watchdog thread that, whenever the loop's heartbeat is older than a
threshold, samples the Python stacks of every thread (the loop's, the engine's step thread, the tokenizer
pool), plus every garbage collection with its duration. A stall of the loop thread is either its own
long callback (its stack shows it) or the GIL held elsewhere (its stack sits at a GIL re-acquire, and
the holder's stack shows what held it). Used by w2_stream.py --lag-trace; prints nothing itself.

The watchdog needs the GIL to sample, so it sees a stall a little late; the heartbeat is the ticker's,
which runs on the loop every millisecond.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LagTrace:
    threshold_s: float
    heartbeat: float = field(default_factory=time.perf_counter)
    samples: Counter[str] = field(default_factory=Counter)
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (start from t0, duration), seconds
    gcs: list[tuple[int, float]] = field(default_factory=list)  # (generation, seconds)
    t0: float = field(default_factory=time.perf_counter)
    beats: int = 0

    def beat(self) -> None:
        now = time.perf_counter()
        if self.beats and now - self.heartbeat > self.threshold_s:
            self.stalls.append((self.heartbeat - self.t0, now - self.heartbeat))
        self.heartbeat = now
        self.beats += 1

    def summary(self, top: int = 8) -> dict[str, Any]:
        longest = sorted(self.stalls, key=lambda s: -s[1])[:10]
        return {
            "lag_trace_threshold_ms": self.threshold_s * 1000,
            "stalls": len(self.stalls),
            "longest_stalls_ms_at_s": [[round(d * 1000, 1), round(t, 2)] for t, d in longest],
            "gc_count_by_gen": dict(Counter(g for g, _ in self.gcs)),
            "gc_max_ms": round(max((d for _, d in self.gcs), default=0.0) * 1000, 2),
            "stall_stacks": [[n, s] for s, n in self.samples.most_common(top)],
        }


_IDLE = {"wait", "get", "select", "_worker", "acquire"}


def _stack(frame: Any, depth: int) -> str:
    frames = traceback.extract_stack(frame)[-depth:]
    return " < ".join(f"{f.name}({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(frames))


@contextmanager
def lag_trace(threshold_s: float = 0.004, poll_s: float = 0.0005, depth: int = 4) -> Iterator[LagTrace]:
    """Call `trace.beat()` from a ticker on the loop; samples every thread's stack while a beat is late."""
    trace = LagTrace(threshold_s)
    loop_thread = threading.get_ident()
    stop = threading.Event()
    gc_start: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            trace.gcs.append((int(info["generation"]), time.perf_counter() - gc_start.pop()))

    def watch() -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        while not stop.wait(poll_s):
            if not trace.beats or time.perf_counter() - trace.heartbeat <= threshold_s:
                continue
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                who = "loop" if ident == loop_thread else names.get(ident, "?")
                if who != "loop" and frame.f_code.co_name in _IDLE:
                    continue  # a pool thread parked on its queue holds no GIL
                trace.samples[f"{who}: {_stack(frame, depth)}"] += 1

    gc.callbacks.append(on_gc)
    watcher = threading.Thread(target=watch, name="lag-trace", daemon=True)
    watcher.start()
    try:
        yield trace
    finally:
        stop.set()
        watcher.join()
        gc.callbacks.remove(on_gc)
