"""An engine's lifetime outside its API: building its core where the core runs (torch loads only then), a
drain's waits and the error a draining engine answers with, and the order of a shutdown with its bounded
waits. No torch at import.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from asyncllm import envs
from asyncllm.async_engine.admission import Admission
from asyncllm.async_engine.core_client import EngineCoreClient
from asyncllm.async_engine.ids import LiveRequests
from asyncllm.async_engine.inproc_client import Built
from asyncllm.async_engine.loops import run_in_thread
from asyncllm.config import EngineConfig
from asyncllm.errors import EngineDrainingError

_SHUTDOWN_JOIN_S = 60.0  # longest a shutdown waits for a step in flight before giving up on the join
_DRAIN_ABORT_S = 5.0  # after a drain's timeout, how long it waits for its aborts to land (within a step)
_WAIT_SLICE_S = 0.25  # a drain waits in slices: cancelling it leaves a thread blocked this long at most


def build_core(config: EngineConfig) -> Built:
    from asyncllm.build import build_engine  # torch loads only now, where the core runs

    return build_engine(config, time.monotonic)


def draining_error() -> EngineDrainingError:
    return EngineDrainingError("the engine is draining: it finishes the requests it has and takes no new ones")


async def drain(live: LiveRequests[Any], abort: Callable[[Any], None], timeout: float | None) -> int:
    """`AsyncLLMEngine.drain`: stop admitting, wait up to `timeout` for the live requests to end, then
    `abort` each one left and wait for those aborts to land; returns how many were aborted."""
    live.stop_admitting(draining_error)
    deadline = None if timeout is None else time.monotonic() + timeout
    if await _wait_empty(live, deadline):
        return 0
    slots = live.slots()
    for slot in slots:
        abort(slot)
    await _wait_empty(live, time.monotonic() + _DRAIN_ABORT_S)
    return len(slots)


async def _wait_empty(live: LiveRequests[Any], deadline: float | None) -> bool:
    """Wait off the loop until no request is live (True) or `deadline` (time.monotonic()) passed."""
    while len(live):
        left = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - time.monotonic())
        if left <= 0:
            return False
        await run_in_thread(functools.partial(live.wait_empty, left))
    return True


def shutdown(client: EngineCoreClient, admission: Admission) -> None:
    client.request_stop()  # streams fail first, so the tokenizer thread skips what is left in its queue
    admission.stop(_SHUTDOWN_JOIN_S)
    # A dead engine has no step in flight, only its release of the device, which can block for good: the
    # shutdown waits a shorter bound, then leaves the (daemon) thread.
    client.shutdown(envs.DEAD_ENGINE_JOIN_S.get() if client.failure is not None else _SHUTDOWN_JOIN_S)
