"""What every engine argument is made of: a dataclass field carrying its one line of documentation (`arg`),
and the checks' shared pieces (the `InvalidConfigError` naming a field, the value and the fix; setting a
frozen field once while normalising it; a local path). Plain Python; no torch. Used by `config.py` and
`config_device.py` alike.
"""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Any

from asyncllm.errors import InvalidConfigError


def arg(default: Any, doc: str) -> Any:
    """A dataclass field that is an engine argument: its default and the one line users read about it."""
    return field(default=default, metadata={"doc": doc})


def invalid(name: str, value: object, allowed: str) -> InvalidConfigError:
    """The error for field `name` holding `value`, saying what is `allowed`."""
    return InvalidConfigError(f"{name}={value!r} is invalid: use {allowed}")


def set_field(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclasses normalise their own fields once, here


def local_path(name: str, value: object, *, optional: bool) -> str | None:
    if optional and value is None:
        return None
    if not isinstance(value, (str, Path)) or str(value) == "":
        raise invalid(name, value, "a local path" + (", or None" if optional else ""))
    return str(value)
