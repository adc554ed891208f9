"""The one set of value checks behind engine arguments and sampling parameters.

Each check takes the field's name, its value and an error factory, and raises that factory's error with a
message naming the field, the value and what is allowed. Plain Python; knows no field of its own.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable
from typing import TypeVar

Fail = Callable[[str, object, str], Exception]  # (name, value, allowed) -> the error to raise
E = TypeVar("E", bound=enum.Enum)


def short_repr(value: object, limit: int = 80) -> str:
    """repr(value) cut to about `limit` characters, for error messages that echo a caller's value.

    Never raises: a 5,000-digit int has no repr in Python 3.11+ (int-to-str conversion is capped), and a
    value nested ~1,000 deep has none either (repr recurses).
    """
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<int of {value.bit_length()} bits>" if isinstance(value, int) else f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text)} characters)"


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
    float32: bool = False,
) -> float:
    """A finite real in [lo, hi] (or (lo, hi] with lo_open) as a float.

    Ints are accepted but must convert to a finite float: 10**400 is an int Python holds exactly, and
    float() of it raises OverflowError; a check that compared it as an int let it through to the device.
    With `float32`, the bounds are checked on the value rounded to float32, which the device computes
    with: 1e39 overflows it to inf and 1e-300 rounds to 0, though both are finite, non-zero float64s.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(name, value, allowed)
    try:
        number = float(value)
    except OverflowError:
        raise fail(name, value, allowed) from None
    if not math.isfinite(number):
        raise fail(name, value, allowed)
    if float32:  # bounds rounded alike: 0.01 itself rounds below 0.01 in float32 and must still pass
        lo32 = None if lo is None else as_float32(lo)
        hi32 = None if hi is None else as_float32(hi)
        if not _in_range(as_float32(number), lo32, hi32, lo_open):
            raise fail(name, value, allowed)
    if not _in_range(number, lo, hi, lo_open):
        raise fail(name, value, allowed)
    return number


def as_float32(number: float) -> float:
    """`number` rounded to the nearest float32 (inf past its largest finite value)."""
    try:
        return float(struct.unpack("f", struct.pack("f", number))[0])
    except OverflowError:  # struct refuses values beyond float32's range rather than rounding them to inf
        return math.copysign(math.inf, number)


def _in_range(number: float, lo: float | None, hi: float | None, lo_open: bool) -> bool:
    if not math.isfinite(number):
        return False
    if lo is not None and (number < lo or (lo_open and number == lo)):
        return False
    return hi is None or number <= hi


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
