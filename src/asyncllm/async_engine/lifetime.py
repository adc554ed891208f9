"""An engine's lifetime outside its API: building its core where the core runs (torch loads only then), the
error a draining engine answers with, and the order of a shutdown with its bounded waits. No torch at import.
"""

from __future__ import annotations

import time

from asyncllm import envs
from asyncllm.async_engine.admission import Admission
from asyncllm.async_engine.core_client import EngineCoreClient
from asyncllm.async_engine.inproc_client import Built
from asyncllm.config import EngineConfig
from asyncllm.errors import EngineDrainingError

_SHUTDOWN_JOIN_S = 60.0  # longest a shutdown waits for a step in flight before giving up on the join


def build_core(config: EngineConfig) -> Built:
    from asyncllm.build import build_engine  # torch loads only now, where the core runs

    return build_engine(config, time.monotonic)


def draining_error() -> EngineDrainingError:
    return EngineDrainingError("the engine is draining: it finishes the requests it has and takes no new ones")


def shutdown(client: EngineCoreClient, admission: Admission) -> None:
    client.request_stop()  # streams fail first, so the tokenizer thread skips what is left in its queue
    admission.stop(_SHUTDOWN_JOIN_S)
    # A dead engine has no step in flight, only its release of the device, which can block for good: the
    # shutdown waits a shorter bound, then leaves the (daemon) thread.
    client.shutdown(envs.DEAD_ENGINE_JOIN_S.get() if client.failure is not None else _SHUTDOWN_JOIN_S)
