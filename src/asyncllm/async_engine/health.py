"""Engine health beyond alive or dead: the age of the step in flight, and the error for a stalled engine.

A step that runs far longer than any real step means a stuck device or kernel; `check_health` reports it
so a load balancer stops sending work. Reads what the step thread publishes; knows nothing else.
"""

from __future__ import annotations

import time

from asyncllm.errors import EngineStalledError

__all__ = ["EngineStalledError", "check_step_age", "step_age"]


def step_age(started: float | None) -> float:
    """Seconds since `started` (a time.monotonic() reading), 0.0 for None (no step in flight)."""
    return 0.0 if started is None else max(0.0, time.monotonic() - started)


def check_step_age(age: float, max_step_seconds: float) -> None:
    if age > max_step_seconds:
        raise EngineStalledError(
            f"engine step has been running for {age:.1f} s (bound {max_step_seconds} s): "
            "the device or a kernel seems stuck"
        )
