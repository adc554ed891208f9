"""Engine builders that replicas run (pickled by reference, imported in each replica's process): the fake
core of tests/fixtures, a replica that is slow to start again, one that a poisoned prompt kills, and one
that cannot load. No pytest here: replicas import this module."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from asyncllm.errors import InvalidConfigError
from tests.fixtures.fake_core import FakeBuilt, fake_built
from tests.fixtures.fake_executor import InjectedFailure, hash_next_token

VOCAB = 384
POISON = 383  # a prompt holding this id kills the step that computes it (the next-token function never returns it)
_next = hash_next_token(VOCAB, frozenset({0, POISON}))


def next_token(tokens: Sequence[int]) -> int:
    if POISON in tokens:
        raise InjectedFailure("a poisoned prompt reached the model")
    return _next(tokens)


def build(step_delay: float = 0.0, restart_marker: str | None = None, restart_delay: float = 0.0) -> FakeBuilt:
    """The fake core (token ids only, block size 4); while `restart_marker` exists, loading takes
    `restart_delay` seconds (the test creates it before killing a replica)."""
    if restart_marker is not None and Path(restart_marker).exists():
        time.sleep(restart_delay)
    return fake_built(None, vocab_size=VOCAB, next_token=next_token, step_delay=step_delay)


def reference() -> FakeBuilt:
    """A core in this process computing what every replica computes (for `offline_run`)."""
    return fake_built(None, vocab_size=VOCAB, next_token=next_token)


def cannot_load() -> FakeBuilt:
    raise InvalidConfigError("num_kv_blocks=1 is too small: the replica's test builder refuses it")
