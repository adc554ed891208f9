"""Where the step thread's time goes, per engine step: wall and thread CPU time of each phase of a step.

The phases are the engine's own functions, wrapped for the run (bench-only instrumentation, undone on exit):

    schedule      Scheduler.schedule             planning the next step
    runner        ModelRunner.submit             inputs, the forward launch (graph replay), sampling launches
      prepare     InputBuffers.prepare           (part of runner) the step's inputs into their buffers
      sample      Sampler.__call__               (part of runner) the sampler's launches
    wait          the sampled ids' event         waiting for the device (overlapped: for the previous step)
    read          EngineCore._read minus wait    a step's tokens in (a constrained step's to its grammar)
    update        EngineCore._update             turning sampled ids into deltas (detokenizing included)
    route         OutputRouter.route             (async engine only) handing deltas to the event loops
    loop_flush    LoopMailbox._flush             (async engine only; on the event loop's thread) handing each
                                                 step's chunks to the waiting streams (their wake-ups not included)

Each phase is also summed by the kind of step last scheduled (`by_kind`): `prompt` steps carry prompt tokens
(admission, chunks), `decode` steps one token per sequence; `step` is the step thread's whole iteration,
from one `schedule` call to the next. With overlap the wait and output phases that follow a schedule call
belong to the step before it, so read `by_kind` for where a kind's iterations spend their time.

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
    ("asyncllm.core.engine_core", "EngineCore", "_read", "read"),
    ("asyncllm.core.engine_core", "EngineCore", "_update", "update"),
    ("asyncllm.async_engine.router", "OutputRouter", "route", "route"),
    ("asyncllm.async_engine.mailbox", "LoopMailbox", "_flush", "loop_flush"),
)
# Structured output's host work (`host_timing(grammar=True)`; w6_structured.py --host-timing):
#   grammar_accept  GrammarTable.advance  (part of read) the step's tokens to the matchers, the next rows
#                                          filled (in this thread) or handed to the grammar process
#   grammar_fill    GrammarTable.fill     (part of runner) waiting for every home's rows, uploading the mask
#   grammar_plan    GrammarTable.plan     (part of runner) which bitmask row each sampled row reads
GRAMMAR_PHASES = (
    ("asyncllm.structured_output.grammar_table", "GrammarTable", "advance", "grammar_accept"),
    ("asyncllm.structured_output.grammar_table", "GrammarTable", "fill", "grammar_fill"),
    ("asyncllm.structured_output.grammar_table", "GrammarTable", "plan", "grammar_plan"),
)


@dataclass
class HostTiming:
    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    kind: str = "idle"  # of the step last scheduled
    by_kind: dict[str, HostTiming] = field(default_factory=dict)
    _iteration: tuple[float, float] | None = None  # wall, CPU at the last schedule call

    def add(self, phase: str, wall: float, cpu: float, kind: str | None = None) -> None:
        self.wall[phase] = self.wall.get(phase, 0.0) + wall
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu
        self.calls[phase] = self.calls.get(phase, 0) + 1
        if kind is not None:
            self.by_kind.setdefault(kind, HostTiming()).add(phase, wall, cpu)

    def scheduled(self, out: Any) -> None:
        """After a `schedule` call: close the iteration that ended here, open one of the new step's kind."""
        now = time.perf_counter(), time.thread_time()
        if self._iteration is not None:
            self.by_kind.setdefault(self.kind, HostTiming()).add(
                "step", now[0] - self._iteration[0], now[1] - self._iteration[1]
            )
        self._iteration = now
        seqs = getattr(out, "seqs", [])
        self.kind = "idle" if not seqs else "prompt" if sum(s.num_tokens for s in seqs) > len(seqs) else "decode"

    def summary(self) -> dict[str, Any]:
        """Per phase: calls, and wall / CPU milliseconds per engine step (a step: one `schedule` call);
        the same per kind of step under `by_kind`."""
        out = self._phases()
        out["by_kind"] = {
            kind: {"steps": t.calls.get("step", 0), **t._phases(per="step")["host_ms_per_step"]}
            for kind, t in sorted(self.by_kind.items())
        }
        return out

    def _phases(self, per: str = "schedule") -> dict[str, Any]:
        wall, cpu = dict(self.wall), dict(self.cpu)
        if "read" in wall and "wait" in wall:  # read's own work, without the wait inside it
            wall["read"] -= wall["wait"]
            cpu["read"] -= cpu["wait"]
        steps = max(1, self.calls.get(per, 0))
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
        on_step_thread = phase != "loop_flush"
        kind = timing.kind
        result = None
        try:
            result = fn(*args, **kwargs)
            return result
        finally:
            if phase == "schedule":  # planning counts toward the step it plans
                timing.scheduled(result)
                kind = timing.kind
            timing.add(phase, time.perf_counter() - w0, time.thread_time() - c0, kind if on_step_thread else None)

    return wrapper


@contextmanager
def host_timing(grammar: bool = False) -> Iterator[HostTiming]:
    """Wrap the phases' functions for the duration (every engine in this process); yields the totals.
    `grammar`: structured output's phases too."""
    timing = HostTiming()
    undo: list[tuple[type, str, Any]] = []
    try:
        for module, cls_name, method, phase in _PHASES + (GRAMMAR_PHASES if grammar else ()):
            cls = getattr(importlib.import_module(module), cls_name)
            original = cls.__dict__[method]
            undo.append((cls, method, original))
            setattr(cls, method, _timed(original, phase, timing))
        yield timing
    finally:
        for cls, method, original in reversed(undo):
            setattr(cls, method, original)
