"""Tuning knobs that are not engine arguments: `ASYNCLLM_*` environment variables, each declared here once
with its type, default and meaning, and read when it is used (never at import), so a test or a benchmark
that sets one affects the engines it makes next. Users should need none of them; a bad value fails where
it is read, naming the variable. Imports nothing of the package but its errors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from asyncllm.errors import InvalidConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        """The variable's value now: its default when unset or empty."""
        raw = os.environ.get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError as exc:
            raise InvalidConfigError(f"{self.name}={raw!r} is invalid ({exc}): {self.doc}") from exc


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value == float("inf"):  # NaN fails too
        raise ValueError("give a finite number of seconds > 0")
    return value


DEAD_ENGINE_JOIN_S: EnvVar[float] = EnvVar(
    "ASYNCLLM_DEAD_ENGINE_JOIN_S",
    6.0,
    _seconds,
    "seconds a dead engine's shutdown waits for its step thread to release the device before leaving it "
    "(a kernel stuck on a dead tensor-parallel peer can block that release for good); above the executor's "
    "own bound on the release (3 s) plus its stop of the workers (1 s)",
)

ALL: tuple[EnvVar[Any], ...] = (DEAD_ENGINE_JOIN_S,)  # every variable, for docs/tuning.md's table and its test
