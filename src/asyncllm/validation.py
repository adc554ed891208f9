"""The one set of value checks behind engine arguments and sampling parameters.

Each check takes the field's name, its value and an error factory, and raises that factory's error with a
message naming the field, the value and what is allowed. Plain Python; knows no field of its own.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import TypeVar

Fail = Callable[[str, object, str], Exception]  # (name, value, allowed) -> the error to raise
E = TypeVar("E", bound=enum.Enum)


def is_int(value: object) -> bool:
    """An int that is not a bool (True is an int to Python, never a count or an id to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(fail: Fail, name: str, value: object, allowed: str, *, lo: int | None = None) -> int:
    if not is_int(value) or (lo is not None and value < lo):  # type: ignore[operator]
        raise fail(name, value, allowed)
    return value  # type: ignore[return-value]


def check_optional_int(fail: Fail, name: str, value: object, allowed: str, *, lo: int | None = None) -> int | None:
    return None if value is None else check_int(fail, name, value, allowed, lo=lo)


def check_float(
    fail: Fail,
    name: str,
    value: object,
    allowed: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    """A finite real in [lo, hi] (or (lo, hi] with lo_open) as a float.

    Ints are accepted but must convert to a finite float: 10**400 is an int Python holds exactly, and
    float() of it raises OverflowError; a check that compared it as an int let it through to the device.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(name, value, allowed)
    try:
        number = float(value)
    except OverflowError:
        raise fail(name, value, allowed) from None
    if not math.isfinite(number):
        raise fail(name, value, allowed)
    if lo is not None and (number < lo or (lo_open and number == lo)):
        raise fail(name, value, allowed)
    if hi is not None and number > hi:
        raise fail(name, value, allowed)
    return number


def check_bool(fail: Fail, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise fail(name, value, "True or False")
    return value


def check_enum(fail: Fail, cls: type[E], name: str, value: object) -> E:
    """`value` as a member of `cls` (members or their values are accepted)."""
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise fail(name, value, f"one of {allowed}") from None
