"""Turning an optional fast path on across ranks: all of them or none.

A rank on one collective path while a peer waits on another hangs both, so every rank sets the path up, then
checks it, and the group decides each stage together (`all_agree`: true only if true on every rank). A
set-up failure is local and safe to vote on: each rank fails before any collective of the path. A check that
raises is not: its peers may be waiting inside one of the check's collectives, so the error propagates (the
engine fails to start, naming it) rather than being voted on. Plain Python: the collectives come in as calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def choose_together(
    open_path: Callable[[], T],
    check: Callable[[T], bool],
    all_agree: Callable[[bool], bool],
    close: Callable[[T], None],
) -> tuple[T, str] | tuple[None, str]:
    """(the opened path, "") when every rank opened it and every rank's check passed; else (None, why) with
    whatever this rank opened closed. Every rank must call this at once, with the same collectives."""
    opened: T | None = None
    why = "a peer rank could not set it up"
    try:
        opened = open_path()
    except Exception as exc:
        why = f"set-up failed: {exc!r}"
    if not all_agree(opened is not None):
        if opened is not None:
            close(opened)
        return None, why
    assert opened is not None
    checked = check(opened)
    if all_agree(checked):
        return opened, ""
    close(opened)
    return None, "a peer rank's check failed" if checked else "its results differ from the backend's"
