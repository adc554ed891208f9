"""The engine core in a process of its own: an `EngineCoreClient` over two pipes (vLLM V1's split).

`start()` launches a fresh interpreter (`core_proc.py`; never a fork, and never a re-import of the caller's
main module) and sends it `build`, pickled; the core process builds the engine and runs the in-process step
loop there, so the core's Python work (scheduling, detokenizing, output processing) no longer shares a GIL
with the callers' event loops. Requests, aborts and ends go down one pipe in call order; each step's outputs
come back as one message (`core_wire`), which a reader thread here routes through the engine's
`OutputRouter`, exactly as the step thread does in-process. Why pipes: one message per step each way, a
few kilobytes, costs two system calls; a blocked reader wakes the moment data arrives (no spinning, unlike
a shared-memory ring's readers); and the pipe's end-of-file is the news that the other side died, at once
and whatever killed it. The start of the step in flight, which health checks read between messages, lives
in eight bytes of shared memory. Knows nothing of event loops, nor of how a core is built.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import mmap
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from asyncllm.async_engine import core_wire as wire
from asyncllm.errors import AsyncLLMError, EngineDeadError

if TYPE_CHECKING:
    from asyncllm.async_engine.inproc_client import Built
    from asyncllm.async_engine.mailbox import OutputSlot
    from asyncllm.async_engine.router import OutputRouter
    from asyncllm.chat import ChatTokenizer
    from asyncllm.core.output_processor import RequestDelta
    from asyncllm.core.request import Request
    from asyncllm.input_processor import CheckConstraint, Encode, EncodeBatch
    from asyncllm.step import RuntimeInfo
    from asyncllm.structured import StructuredOutput

logger = logging.getLogger(__name__)

_ENTRY = "from asyncllm.async_engine.core_proc import main; main()"
_STEP = struct.Struct("<d")  # as core_proc writes it: time.monotonic(), NaN between steps
_EXIT_WAIT_S = 1.0  # after the pipe closed, how long the process may take to report its exit status


class CoreProcessDiedError(AsyncLLMError, RuntimeError):
    """The engine core's process exited without being asked to (killed, crashed): the engine cannot go on."""


@dataclass(frozen=True)
class _Info:
    runtime: RuntimeInfo
    tokenizer: ChatTokenizer | None
    encode: Encode | None
    encode_batch: EncodeBatch | None
    check_constraint: CheckConstraint | None


class ProcClient:
    """`EngineCoreClient` over a core that `build()` (picklable: a module-level function, or a partial of
    one) makes in a process of its own."""

    def __init__(self, build: Callable[[], Built], router: OutputRouter) -> None:
        self._build = build
        self._router = router
        self._lock = threading.RLock()  # held to send, so messages go in call order; admission shares it
        self._stopping = False
        self.failure: BaseException | None = None  # what killed the core (None: serving, or shut down)
        self._stats: dict[str, float | int] = {}  # replaced (never mutated) by every step's message
        self._calls: dict[int, Future[None]] = {}  # calls into the core awaiting its answer
        self._call_ids = itertools.count()
        self._proc: subprocess.Popen[bytes] | None = None
        self._to_core: Connection | None = None
        self._from_core: Connection | None = None
        self._step_clock: mmap.mmap | None = None
        self._reader = threading.Thread(target=self._read, name="asyncllm-core-reader", daemon=True)

    # ------------------------------------------------------------------ any thread
    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def start(self) -> _Info:
        """Launch the core process and wait until it has built the engine; re-raise its load error here."""
        self._launch()
        assert self._from_core is not None
        while True:
            try:
                message = self._from_core.recv()
            except (EOFError, OSError):
                error: BaseException = CoreProcessDiedError(f"{self._describe_exit()} while loading the engine")
                break
            except KeyboardInterrupt:  # Ctrl-C, which the core ignores: its load would run on, orphaned
                assert self._proc is not None
                self._proc.kill()
                self._router.close("engine load interrupted", None)
                self._stop_process(None)
                self._from_core.close()
                raise
            if message[0] == wire.READY:
                _, runtime, tokenizer, encode, encode_batch, can_check = message
                self._reader.start()
                check = self._check_constraint if can_check else None
                return _Info(runtime, tokenizer, encode, encode_batch, check)
            if message[0] == wire.FAILED:
                error = message[1]
                break
        self._router.close("engine failed to load", error)
        self._stop_process(_EXIT_WAIT_S)
        self._from_core.close()
        raise error

    def add_request(self, request: Request, slot: OutputSlot) -> None:
        with self._lock:
            if not self._stopping and self._router.is_live(slot):
                self._send((wire.ADD, request))

    def abort_request(self, slot: OutputSlot) -> None:
        # Checked and sent under the lock: a request reusing the id is added only after this request's end
        # was routed, so its add follows this abort down the pipe, and the core never mistakes the two.
        with self._lock:
            if not self._stopping and self._router.is_live(slot):
                self._send((wire.ABORT, slot.request_id))

    def end_request(self, slot: OutputSlot, delta: RequestDelta) -> None:
        # Through the core and back, so it is routed in order with what was sent before it.
        with self._lock:
            if not self._stopping:
                self._send((wire.END, slot.request_id, delta))

    def stats(self) -> dict[str, float | int]:
        return dict(self._stats)

    @property
    def step_started(self) -> float | None:
        clock = self._step_clock
        if clock is None:
            return None
        value: float = _STEP.unpack_from(clock)[0]
        while value != (again := _STEP.unpack_from(clock)[0]) and not math.isnan(again):
            value = again  # a write landed between the reads: read until two agree
        return None if math.isnan(value) else value

    @property
    def pid(self) -> int | None:
        """The core process's id (None before `start`), for monitoring."""
        return None if self._proc is None else self._proc.pid

    @property
    def is_alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None and self._reader.is_alive()

    def request_stop(self) -> None:
        """The core process stops after the step in flight, releases the device and exits."""
        self._router.close("engine shut down", None)
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._send((wire.STOP,))

    def shutdown(self, timeout: float | None = None) -> None:
        """`request_stop`, then wait for the process to exit (killed after `timeout`) and the reader to end."""
        self.request_stop()
        if threading.current_thread() is self._reader:
            return
        self._stop_process(timeout)
        if self._reader.is_alive():
            self._reader.join(5.0)

    # ------------------------------------------------------------------ the core process
    def _launch(self) -> None:
        try:
            build = pickle.dumps(self._build)  # fail here, in the caller, not as a core that never starts
        except Exception as exc:
            raise TypeError(
                f"the engine core's builder must pickle to run in a process of its own (a module-level function, "
                f"or a functools.partial of one, with picklable arguments): {exc}"
            ) from exc
        env = dict(os.environ)
        # The child finds asyncllm (and the module `build` comes from) where this process does.
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        # Unlinked at once: nothing is left behind whatever happens; both processes map its 8 bytes.
        with tempfile.TemporaryFile() as clock:
            clock.write(_STEP.pack(math.nan))
            clock.flush()
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _ENTRY, str(to_r), str(from_w), str(clock.fileno())],
                    pass_fds=(to_r, from_w, clock.fileno()),
                    env=env,
                )
                self._step_clock = mmap.mmap(clock.fileno(), _STEP.size)
            except BaseException:
                os.close(to_w)
                os.close(from_r)
                raise
            finally:
                os.close(to_r)  # only the child holds these ends now: their closing means what it should
                os.close(from_w)
        self._to_core = Connection(to_w, readable=False)
        self._from_core = Connection(from_r, writable=False)
        self._send((build, logging.getLogger("asyncllm").getEffectiveLevel()))

    def _send(self, message: tuple[Any, ...]) -> None:
        assert self._to_core is not None
        # OSError: the core process is gone; the reader has seen, or is about to see, its pipe close.
        with contextlib.suppress(OSError):
            self._to_core.send(message)

    def add_lora(self, name: str, path: str) -> Future[None]:
        return self._call(wire.ADD_LORA, name, path)

    def remove_lora(self, name: str) -> Future[None]:
        return self._call(wire.REMOVE_LORA, name)

    def _check_constraint(self, spec: StructuredOutput) -> None:
        """`check_constraint` for the front: compiled in the core process (its compiler's cache is the one
        the steps use), the error raised here. Called off the event loops (the tokenizer thread)."""
        self._call(wire.CHECK_CONSTRAINT, spec).result()

    def _call(self, what: str, *args: Any) -> Future[None]:
        """Ask the core to run `what(*args)`; the future gets its error, or `EngineDeadError` if it stops first."""
        future: Future[None] = Future()
        with self._lock:
            if self._stopping:
                future.set_exception(EngineDeadError("the engine is not running"))
                return future
            call = next(self._call_ids)
            self._calls[call] = future
            self._send((wire.CALL, call, what, args))
        return future

    def _read(self) -> None:
        """The reader thread: route each step's outputs, answer checks, until the core's pipe closes."""
        assert self._from_core is not None
        conn, router = self._from_core, self._router
        try:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    break
                kind = message[0]
                if kind == wire.STEP:
                    started, stats, deltas = wire.decode_step(message)
                    router.started(started)
                    self._stats = stats  # before routing: a finished stream sees its blocks freed
                    for slot in router.route(deltas):  # their event loop is closed: stop computing them
                        self.abort_request(slot)
                elif kind == wire.RETURNED:
                    future, error = self._calls.pop(message[1]), message[2]
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(error)
                elif kind == wire.DEAD and not self._stopping:  # the core failed; it has released the device
                    self.failure = message[2]
                    router.close(message[1], message[2])
                    with self._lock:  # and its process may go
                        self._stopping = True
                        self._send((wire.STOP,))
        except BaseException as exc:  # a fault here kills the engine, never silently
            self.failure = exc
            logger.error("asyncllm: reading the engine core's outputs failed; the engine is dead", exc_info=exc)
        finally:
            conn.close()
            self._core_gone()

    def _core_gone(self) -> None:
        """The core's pipe closed (it exited) or its reader failed: every stream and check ends now."""
        if not self._stopping and self.failure is None:
            self.failure = CoreProcessDiedError(self._describe_exit())
            logger.error("%s: the engine is dead", self.failure)
        else:
            self._describe_exit()  # reaps it: no zombie is left behind
        if self.failure is not None:
            router_message = f"engine core process failed: {self.failure!r}"
            self._router.close(router_message, self.failure)  # a no-op once closed (DEAD, or a shutdown)
        with self._lock:
            self._stopping = True
        with self._lock:
            calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineDeadError("the engine stopped before it could run this call"))

    def _describe_exit(self) -> str:
        proc = self._proc
        assert proc is not None
        try:
            code: int | None = proc.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"the engine core process (pid {proc.pid}) {how}"

    def _stop_process(self, timeout: float | None) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("asyncllm engine core process (pid %s) busy %s s after shutdown: killed", proc.pid, timeout)
            proc.kill()
            proc.wait()
        if self._to_core is not None:
            self._to_core.close()  # the reader closes the other pipe once the process's end of it closed
