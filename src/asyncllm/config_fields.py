"""What every engine argument is made of: a dataclass field carrying its one line of documentation (`arg`),
and the checks' shared pieces (the `InvalidConfigError` naming a field, the value and the fix; setting a
frozen field once while normalising it; a local path). Plain Python; no torch. Used by `config.py` and
`config_device.py` alike.
"""

from __future__ import annotations

import os
from dataclasses import field
from pathlib import Path
from typing import Any

from asyncllm.errors import InvalidConfigError


def arg(default: Any, doc: str) -> Any:
    """A dataclass field that is an engine argument: its default and the one line users read about it."""
    return field(default=default, metadata={"doc": doc})


def from_env(variable: Any) -> Any:
    """A dataclass field that is not an engine argument: its value comes from an `ASYNCLLM_*` variable
    (`asyncllm.envs`) read when the config part is made; internal callers (tests, `from_builder`) may still pass
    it. `engine_arguments()` leaves it out, so no user or flag can name it."""
    return field(default_factory=variable.get, metadata={"env": variable.name})


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


def writable_dir(name: str, value: object) -> str | None:
    """A directory this process can write, made if missing; None stays None. A path that is a file, or a
    directory that cannot be made or written, is an `InvalidConfigError` naming `name` and the reason."""
    path_text = local_path(name, value, optional=True)
    if path_text is None:
        return None
    path = Path(path_text).expanduser()
    if path.exists() and not path.is_dir():
        raise InvalidConfigError(f"{name}={path_text!r} is a file, not a directory: give a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidConfigError(f"{name}={path_text!r} cannot be created: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidConfigError(f"{name}={path_text!r} is not writable by this process: give a writable directory")
    return str(path)
