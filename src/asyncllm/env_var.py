"""How an `ASYNCLLM_*` variable is declared (`EnvVar`: name, default, parser, meaning) and the parsers its values
go through; envs.py declares the variables themselves. A bad value raises InvalidConfigError naming the variable
and what it takes. Imports nothing of the package but its errors.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from asyncllm.errors import InvalidConfigError

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


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


def seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value == float("inf"):  # NaN fails too
        raise ValueError("give a finite number of seconds > 0")
    return value


def flag(raw: str) -> bool:
    """A switch: 1 or true, 0 or false (any case)."""
    value = {"1": True, "true": True, "0": False, "false": False}.get(raw.lower())
    if value is None:
        raise ValueError("use 1, 0, true or false")
    return value


def gib_or_auto(raw: str) -> float | None:
    """A positive number of GiB, or "auto" (None: the engine settles it)."""
    if raw.lower() == "auto":
        return None
    value = float(raw)
    if not value > 0 or value == float("inf"):  # NaN fails too
        raise ValueError("use auto or a finite number of GiB > 0")
    return value


def count_or_auto(raw: str) -> int | None:
    """A count of tokens >= 0, or "auto" (None: the engine settles it)."""
    if raw.lower() == "auto":
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError("use auto or an integer >= 0")
    return int(raw)


def positive_or_auto(raw: str) -> int | None:
    """A count >= 1, or "auto" (None: the engine settles it)."""
    value = count_or_auto(raw)
    if value == 0:
        raise ValueError("use auto or an integer >= 1")
    return value


def ms_or_off(raw: str) -> float | None:
    """A finite number of milliseconds > 0, or "off" (None)."""
    if raw.lower() == "off":
        return None
    value = float(raw)
    if not value > 0 or value == float("inf"):  # NaN fails too
        raise ValueError("use off or a finite number of milliseconds > 0")
    return value


def positive(raw: str) -> int:
    """A count >= 1."""
    value = count_or_auto(raw)
    if value is None or value == 0:
        raise ValueError("use an integer >= 1")
    return value


def count(raw: str) -> int:
    """A count >= 0."""
    value = count_or_auto(raw)
    if value is None:
        raise ValueError("use an integer >= 0")
    return value


def one_of(choices: type[E]) -> Callable[[str], E]:
    """One of an enum's values (any case)."""

    def parse(raw: str) -> E:
        for member in choices:
            if member.value == raw.lower():
                return member
        raise ValueError("use one of " + ", ".join(str(m.value) for m in choices))

    return parse
