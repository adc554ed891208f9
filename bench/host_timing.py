"""Where the step thread's time goes, per engine step: wall and thread CPU time of each phase of a step.

The phases are the engine's own functions, wrapped for the run (bench-only instrumentation, undone on exit):

    schedule      Scheduler.schedule             planning the next step
    runner        ModelRunner.submit             inputs, the forward launch (graph replay), sampling launches
      prepare     InputBuffers.prepare           (part of runner) the step's inputs into their buffers
      sample      Sampler.__call__               (part of runner) the sampler's launches
    wait          the sampled ids' event         waiting for the device (overlapped: for the previous step)
    complete      EngineCore._complete minus wait  turning sampled ids into deltas (detokenizing included)
    route         StepLoop._route                (async engine only) handing deltas to the event loops
    loop_flush    LoopMailbox._flush             (async engine only; on the event loop's thread) handing each
                                                 step's chunks to the waiting streams (their wake-ups not included)

Every phase but `loop_flush` runs on the step thread. Wall minus CPU in a phase that never waits for the
device is time the thread spent without the GIL (the event loop, or another thread, held it). If `wait` is
near zero per step, the host is the bottleneck: the device finished each step before the host asked for its
ids.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# (module, class, method, phase)
_PHASES = (
    ("asyncllm.core.scheduler", "Scheduler", "schedule", "schedule"),
    ("asyncllm.worker.model_runner", "ModelRunner", "submit", "runner"),
    ("asyncllm.worker.input_batch", "InputBuffers", "prepare", "prepare"),
    ("asyncllm.sample.sampler", "Sampler", "__call__", "sample"),
    ("asyncllm.worker.sampled_outputs", "_DeviceStep", "result", "wait"),
    ("asyncllm.core.engine_core", "EngineCore", "_complete", "complete"),
    ("asyncllm.async_engine.step_loop", "StepLoop", "_route", "route"),
    ("asyncllm.async_engine.mailbox", "LoopMailbox", "_flush", "loop_flush"),
)


@dataclass
class HostTiming:
    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, wall: float, cpu: float) -> None:
        self.wall[phase] = self.wall.get(phase, 0.0) + wall
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def summary(self) -> dict[str, Any]:
        """Per phase: calls, and wall / CPU milliseconds per engine step (a step: one `schedule` call)."""
        wall, cpu = dict(self.wall), dict(self.cpu)
        if "complete" in wall and "wait" in wall:  # complete's own work, without the wait inside it
            wall["complete"] -= wall["wait"]
            cpu["complete"] -= cpu["wait"]
        steps = max(1, self.calls.get("schedule", 0))
        return {
            "host_timing_steps": steps,
            "host_ms_per_step": {
                p: {"calls": n, "wall": round(1e3 * wall[p] / steps, 3), "cpu": round(1e3 * cpu[p] / steps, 3)}
                for p, n in self.calls.items()
            },
        }


def _timed(fn: Callable[..., Any], phase: str, timing: HostTiming) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            timing.add(phase, time.perf_counter() - w0, time.thread_time() - c0)

    return wrapper


@contextmanager
def host_timing() -> Iterator[HostTiming]:
    """Wrap the phases' functions for the duration (every engine in this process); yields the totals."""
    timing = HostTiming()
    undo: list[tuple[type, str, Any]] = []
    try:
        for module, cls_name, method, phase in _PHASES:
            cls = getattr(importlib.import_module(module), cls_name)
            original = cls.__dict__[method]
            undo.append((cls, method, original))
            setattr(cls, method, _timed(original, phase, timing))
        yield timing
    finally:
        for cls, method, original in reversed(undo):
            setattr(cls, method, original)
