"""The engine core's own process: the entry point `proc_client.ProcClient` starts.

Inside, the in-process client runs unchanged (`InProcClient`: the step thread builds the core, drains its
inbox, steps, routes), around a router that sends instead of delivering: each step's outputs, the ids it
started and the stats snapshot go to the front as one message (`core_wire`), and the core's death as
another. The main thread reads the front's pipe and feeds the inbox (adds, aborts, ends), so an abort
reaches the core within a step, as in-process; output constraints compile on a thread of their own. The
step in flight is published in shared memory for the front's health checks. The process exits when the
front asks, and at once when the front's pipe closes (the front died). Knows nothing of event loops.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
import os
import pickle
import signal
import struct
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, cast

from asyncllm.async_engine import core_wire as wire
from asyncllm.async_engine.compiles import COMPILE_WORKERS
from asyncllm.async_engine.inproc_client import InProcClient
from asyncllm.core.output_processor import RequestDelta

if TYPE_CHECKING:
    from asyncllm.async_engine.mailbox import OutputSlot

_STEP = struct.Struct("<d")  # time.monotonic() when the step in flight began; NaN between steps
_STOP_JOIN_S = 60.0  # as AsyncLLMEngine's shutdown: how long the step in flight may take to end


class _Slot:
    """The core process's stand-in for a front's output slot: one incarnation of a request id."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class _Sender:
    """The pipe to the front; the step thread and the constraint checker both send."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock, contextlib.suppress(OSError):  # the front is gone: the main thread exits
            self._conn.send(message)


class _SendingRouter:
    """What `InProcClient` calls on its router, for a front in another process: outputs are sent, and this
    side keeps which request ids are live here (an abort of one that ended is dropped, as in-process)."""

    def __init__(self, sender: _Sender) -> None:
        self._sender = sender
        self._live: dict[str, _Slot] = {}  # the main thread adds, the step thread removes: one op each
        self._started: list[str] = []
        self._last_stats: tuple[Any, ...] | None = None
        self.stats: Any = dict  # the client's `stats`, set once it exists

    def register(self, request_id: str) -> OutputSlot:
        slot = self._live[request_id] = _Slot(request_id)
        # `InProcClient` reads a slot's `request_id` alone, and hands the slot back to this router.
        return cast("OutputSlot", slot)

    def get(self, request_id: str) -> OutputSlot | None:
        return cast("OutputSlot | None", self._live.get(request_id))

    def is_live(self, slot: Any) -> bool:
        return self._live.get(slot.request_id) is slot

    def started(self, request_ids: Any) -> None:
        self._started.extend(request_ids)  # sent with this step's outputs

    def route(self, deltas: list[RequestDelta]) -> list[Any]:
        live = self._live
        for d in deltas:
            if (d.finish_reason is not None and not d.open_samples) or d.error is not None:
                live.pop(d.request_id, None)
        message = wire.encode_step(self._started, self.stats(), deltas)
        if deltas or self._started or message[2] != self._last_stats:
            self._sender.send(message)
        self._last_stats = message[2]
        self._started = []
        return []  # a closed event loop is the front's to notice: it sends the aborts

    def close(self, message: str, cause: BaseException | None) -> None:
        self._sender.send((wire.DEAD, message, None if cause is None else wire.portable_error(cause)))


class _CoreClient(InProcClient[Any]):
    """The in-process client, publishing the start of each step where the front can read it."""

    def __init__(self, build: Any, router: Any, step_clock: mmap.mmap) -> None:
        self._step_clock = step_clock
        super().__init__(build, router)

    @property
    def step_started(self) -> float | None:
        value: float = _STEP.unpack_from(self._step_clock)[0]
        return None if math.isnan(value) else value

    @step_started.setter
    def step_started(self, value: float | None) -> None:
        _STEP.pack_into(self._step_clock, 0, math.nan if value is None else value)


def main() -> None:
    """`python -c "...; main()" FROM_FRONT_FD TO_FRONT_FD STEP_CLOCK_FD`: serve one core until told to stop."""
    # Ctrl-C reaches the whole process group, and a service manager's SIGTERM often the whole group too: the
    # front decides when the core stops (a server drains first), and the core exits when the front's pipe
    # closes, whatever ended the front.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from_fd, to_fd, clock_fd = (int(arg) for arg in sys.argv[1:4])
    from_front = Connection(from_fd, writable=False)
    sender = _Sender(Connection(to_fd, readable=False))
    step_clock = mmap.mmap(clock_fd, _STEP.size)
    pickled, log_level = from_front.recv()
    _log_to_stderr(log_level)
    try:
        build = pickle.loads(pickled)
    except BaseException as exc:  # e.g. a builder defined in the front's __main__, which this process lacks
        sender.send((wire.FAILED, wire.portable_error(exc)))
        raise SystemExit(1) from None
    router = _SendingRouter(sender)
    client = _CoreClient(build, router, step_clock)
    router.stats = client.stats
    try:
        built = client.start()
    except BaseException as exc:  # the front re-raises it from its own start()
        sender.send((wire.FAILED, wire.portable_error(exc)))
        raise SystemExit(1) from None
    can_check = built.check_constraint is not None
    sender.send((wire.READY, built.runtime, built.tokenizer, built.encode, built.encode_batch, can_check))
    # As many as the front may have in flight (its compiles and the abandoned ones still running): a compile
    # here must never wait behind another, or the front's bound on each would count the wait.
    workers = 2 * COMPILE_WORKERS
    checker = ThreadPoolExecutor(workers, thread_name_prefix="asyncllm-check") if can_check else None
    try:
        _serve(from_front, sender, router, client, built.check_constraint, checker)
    finally:
        if checker is not None:
            checker.shutdown(wait=False, cancel_futures=True)
        client.shutdown(_STOP_JOIN_S)


def _serve(
    from_front: Connection, sender: _Sender, router: _SendingRouter, client: InProcClient[Any], check: Any, checker: Any
) -> None:
    """Feed the front's messages to the core until it says stop (or its pipe closes: it died)."""
    while True:
        try:
            message = from_front.recv()
        except (EOFError, OSError):  # the front died: nobody will read what the core computes
            client.request_stop()
            os._exit(0)
        kind = message[0]
        if kind == wire.ADD:
            request = message[1]
            client.add_request(request, router.register(request.request_id))
        elif kind == wire.ABORT:
            slot = router.get(message[1])
            if slot is not None:
                client.abort_request(slot)
        elif kind == wire.END:
            client.end_request(router.register(message[1]), message[2])
        elif kind == wire.CALL:
            _, call, what, args = message
            if what == wire.CHECK_CONSTRAINT:  # may take a while: never in the way of adds and aborts
                checker.submit(_check, sender, check, call, *args)
            else:  # run by the step thread between two steps, in order with the requests before it
                future = client.add_lora(*args) if what == wire.ADD_LORA else client.remove_lora(*args)
                future.add_done_callback(functools.partial(_returned, sender, call))
        elif kind == wire.STOP:
            return


def _check(sender: _Sender, check: Any, call: int, spec: Any) -> None:
    try:
        check(spec)
    except Exception as exc:  # the caller's error (InvalidRequestError naming the field) or the compiler's
        sender.send((wire.RETURNED, call, wire.portable_error(exc)))
        return
    sender.send((wire.RETURNED, call, None))


def _returned(sender: _Sender, call: int, future: Future[None]) -> None:
    error = future.exception()
    sender.send((wire.RETURNED, call, None if error is None else wire.portable_error(error)))


def _log_to_stderr(level: int) -> None:
    """The front's log level, on stderr (the banner and warnings a core in-process would log)."""
    handler = logging.StreamHandler(sys.stderr)
    # The front's format (asyncllm.console), marked: the server's log reads as one.
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)-7s %(name)s (core process): %(message)s", "%H:%M:%S")
    )
    logger = logging.getLogger("asyncllm")
    logger.addHandler(handler)
    logger.setLevel(level)
