"""`GrammarProcess`: the step thread's end of the grammar process, a `MatcherHome` whose matchers live in a
fresh interpreter (`grammar_worker.py`; never a fork) that fills the bitmask rows straight into the shared
`RowsSegment`. The step thread hands it a step's tokens as soon as they reach the host and waits for its
rows only when the draw is due, so the matchers' work runs beside the step thread's own instead of after it.

Started in the background (`start()`): spawning an interpreter that imports xgrammar takes seconds, and
the step thread never waits for it (`ready` turns True once the worker has its vocabulary). Two pipes: the
requests (closing ours ends the worker at once) and the replies (their end of file is the worker's death).
If it dies, `failure` says so: every request whose matcher it held then ends with that error, and nothing
waits for it again. Knows nothing of steps' plans, only the rows and slots it is handed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection

from asyncllm.errors import AsyncLLMError, RequestFailedError
from asyncllm.structured import StructuredOutput
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.grammar_wire import (
    ACCEPTED,
    DRAFTS,
    FAILED,
    FILL,
    FILLED,
    MARK,
    OPS,
    READY,
    SLOW,
    STEP,
    Init,
    Op,
    decode_reply,
    encode_request,
)
from asyncllm.structured_output.host_rows import HostRows, RowsSegment

logger = logging.getLogger(__name__)

_ENTRY = "from asyncllm.structured_output.grammar_worker import main; main()"
PRECOMPILED_SPECS = 4096  # remembered as sent to compile (one a new distinct constraint: a bounded record)
_EXIT_S = 5.0  # at close, the worker gets this long to leave on its own before it is killed


class GrammarProcess:
    """A `MatcherHome` in another process. `start()` once; then, from the step thread only, the home's calls
    (valid once `ready`). `threads`: how many of the worker's threads fill a step's rows at once."""

    beside = True

    def __init__(
        self,
        backend: GrammarBackend,
        rows: RowsSegment,
        threads: int,
        on_exit: Callable[[], None] | None = None,
        slow_fill_s: float | None = None,
    ) -> None:
        """`on_exit`: called (from a thread of its own) if the worker exits before `close()`: the device may
        be waiting for a mark it will never set. `slow_fill_s`: the worker times its slots' rows and reports
        those past it (`take_slow`)."""
        self.ready = False  # the worker has its vocabulary: requests may be added
        self.failure: AsyncLLMError | None = None  # set once the worker is gone (or never came)
        self.live = 0  # slots in use
        self.pid: int | None = None
        self._backend = backend
        self._rows = rows
        self._threads = threads
        self._free: list[int] = []
        self._next_slot = 0
        self._ops: list[Op] = []  # adds and removes for the next message
        self._seq = 0
        self._unfilled = 0  # FILLED replies still to come
        self._filled_seq = 0  # the last FILLED reply's message
        self._verdict: int | None = None  # the STEP whose ACCEPTED reply `refusals()` waits for
        self._errors: dict[int, str] = {}
        self._stale: dict[int, int] = {}  # removed slot -> the last message sent while its request held it
        self._proc: subprocess.Popen[bytes] | None = None
        self._to: Connection | None = None
        self._from: Connection | None = None
        self._closing = False
        self._on_exit = on_exit
        self._lock = threading.Lock()  # the starter thread and close() over _proc
        self._write_lock = threading.Lock()  # the step thread's messages and `precompile`'s, whole
        self._precompiled: OrderedDict[StructuredOutput, None] = OrderedDict()  # the specs sent to compile
        self._slow_fill_s = slow_fill_s
        self._specs: dict[int, StructuredOutput] = {}  # live slot -> its constraint (for `take_slow`)
        self._slow: list[StructuredOutput] = []  # constraints the worker found slow, not taken yet
        self._starter = threading.Thread(target=self._start, name="asyncllm-grammar-start", daemon=True)

    def start(self) -> None:
        self._starter.start()

    def precompile(self, spec: StructuredOutput) -> None:
        """Have the worker compile `spec` now (its compile thread), as this process's compile starts: from any
        thread (the backend's watcher), so a request's first fill finds its matcher's grammar compiled."""
        with self._write_lock:
            if spec in self._precompiled or self._to is None or self.failure is not None:
                return
            self._precompiled[spec] = None
            if len(self._precompiled) > PRECOMPILED_SPECS:
                self._precompiled.popitem(last=False)
            with contextlib.suppress(OSError):  # a dead worker is the step thread's to notice
                self._to.send_bytes(encode_request(OPS, 0, 0, [("compile", 0, spec)], [], []))

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the worker is ready or could not start (then `failure` says why); True if ready."""
        self._starter.join(timeout)
        return self.ready

    # ------------------------------------------------------------------ the home, from the step thread
    def add(self, spec: StructuredOutput) -> int:
        slot = self._free.pop() if self._free else self._take_new()
        self._ops.append(("add", slot, spec))
        self.live += 1
        self._specs[slot] = spec
        return slot

    def take_slow(self) -> list[StructuredOutput]:
        """The constraints whose requests the worker found slow since the last call (fill_costs.py)."""
        slow, self._slow = self._slow, []
        return slow

    def remove(self, slot: int) -> None:
        self.live -= 1
        self._specs.pop(slot, None)
        if self.failure is None:
            self._ops.append(("remove", slot))
            self._free.append(slot)  # the worker reads the remove before any later add of it
            # Replies to messages sent so far may still report on the slot's last request: not on its next.
            self._stale[slot] = self._seq
            if not self.live:  # no step may come for a while: free the matchers now
                self._send(encode_request(OPS, 0, self._seq + 1, self._ops, [], []), reply=False)

    def step(
        self,
        host: HostRows,
        rows: list[int],
        slots: list[int],
        tokens: list[int],
        verdict: bool,
        sampled_next: Collection[int] = (),
        jump: bool = True,
        mark: int = 0,
        leads: list[list[int]] | None = None,
    ) -> None:
        seq = self._seq + 1
        message = encode_request(STEP, host.index, seq, self._ops, rows, slots, tokens, verdict, mark, leads)
        if self._send(message):
            self._verdict = self._seq if verdict else None

    def drafts(
        self, host: HostRows, rows: list[list[int]], slots: list[int], drafts: list[list[int]], jumps: list[bool]
    ) -> dict[int, int]:
        """Sent (one DRAFTS message; its rows are waited for as any fill's, by `collect` or the set's mark). Its
        matchers never jump forward: no caps."""
        flat_rows = [row for own in rows for row in own]
        flat_slots = [slot for own, slot in zip(rows, slots) for _ in own]
        tokens = [token for own, run in zip(rows, drafts) for token in run[: len(own)]]
        self._send(encode_request(DRAFTS, host.index, self._seq + 1, self._ops, flat_rows, flat_slots, tokens))
        return {}

    def refusals(self) -> dict[int, str]:
        """The last `step`'s refusals when it asked for a verdict (waiting for them); otherwise they come
        with `collect()`, as errors of their slots."""
        seq, self._verdict = self._verdict, None
        refused: dict[int, str] = {}
        while seq is not None and self.failure is None:
            kind, got, payload = self._receive()
            if kind == ACCEPTED and got == seq:
                refused = payload
                break
        return refused

    def forced(self) -> dict[int, list[int]]:
        return {}  # its matchers never jump forward (the process has no tokenizer)

    def fill(self, host: HostRows, rows: list[int], slots: list[int]) -> None:
        self._send(encode_request(FILL, host.index, self._seq + 1, self._ops, rows, slots))

    def mark(self, host: HostRows, mark: int) -> None:
        """Have the worker set `host`'s flag to `mark` once every request sent so far is done."""
        self._send(encode_request(MARK, host.index, self._seq + 1, self._ops, [], [], mark=mark))

    @property
    def last_seq(self) -> int:
        return self._seq

    def alive(self) -> bool:
        """False once the worker is known gone (checked now, without waiting: `failure` is then set)."""
        if self.failure is None and self._proc is not None and self._proc.poll() is not None:
            self._died()
        return self.failure is None

    def collect(self, upto: int | None = None) -> dict[int, str]:
        """Wait until every row asked for is written (`upto`: by the messages up to that one; the replies to
        later ones stay for a later call); the errors of the slots filled since the last call ({} and
        `failure` set if the worker died meanwhile: its rows may be half written)."""
        while self._unfilled and self.failure is None and (upto is None or self._filled_seq < upto):
            self._receive()
        errors, self._errors = self._errors, {}
        return errors

    def close(self) -> None:
        """End the worker (it leaves when its request pipe closes; killed if it does not). Idempotent."""
        self._closing = True
        self._backend.unwatch(self.precompile)
        with self._lock:
            proc = self._proc
        if proc is not None and not self.ready:
            proc.kill()  # still starting: the starter's send or read then fails and it returns
        if self._starter.is_alive():
            self._starter.join()
        with self._write_lock:
            for conn in (self._to, self._from):
                if conn is not None:
                    conn.close()
            self._to = self._from = None
        if proc is not None:
            self._reap()
        self.ready = False

    # ------------------------------------------------------------------ internals
    def _take_new(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def _send(self, message: bytes, reply: bool = True) -> bool:
        if self.failure is not None:
            return False
        assert self._to is not None, "the grammar process is used before it is ready"
        try:
            with self._write_lock:
                self._to.send_bytes(message)
        except OSError:
            self._died()
            return False
        self._ops = []
        self._seq += 1
        self._unfilled += reply
        return True

    def _receive(self) -> tuple[int, int, dict[int, str]]:
        assert self._from is not None
        try:
            kind, seq, payload = decode_reply(self._from.recv_bytes())
        except (EOFError, OSError):
            self._died()
            return FAILED, 0, {}
        if kind == FAILED:
            self._died(payload)
            return kind, seq, {}
        if self._stale:
            payload = {slot: error for slot, error in payload.items() if self._stale.get(slot, -1) < seq}
            for slot in [slot for slot, last in self._stale.items() if last <= seq]:
                del self._stale[slot]  # every reply that could name its last request is in
        if kind == SLOW:  # of its live requests only: a stale slot may serve another constraint now
            self._slow += [self._specs[slot] for slot in payload if slot in self._specs]
        if kind == FILLED:
            self._unfilled -= 1
            self._filled_seq = seq
            self._errors.update(payload)
        return kind, seq, payload

    def _died(self, detail: str = "") -> None:
        code = self._reap()
        how = f"exited with status {code}"
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        self.failure = RequestFailedError(
            f"the grammar process (pid {self.pid}) that held this request's output constraint {how}: the request "
            "cannot go on (the engine carries on; new constrained requests keep their matchers in the step thread)"
        )
        logger.error("%s%s", self.failure, f"\n{detail}" if detail else "")
        self._backend.unwatch(self.precompile)
        with self._write_lock:
            for conn in (self._to, self._from):
                if conn is not None:
                    conn.close()
            self._to = self._from = None

    def _start(self) -> None:
        """The starter thread: spawn the worker, send it the vocabulary, wait for READY."""
        conns: list[Connection] = []
        try:
            request_r, request_w = os.pipe()
            reply_r, reply_w = os.pipe()
            to, frm = Connection(request_w, readable=False), Connection(reply_r, writable=False)
            conns = [to, frm]
            env = dict(os.environ)
            # The child finds asyncllm (and anything else) where this process does.
            paths = [p for p in sys.path if p] + [env.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
            fds = (request_r, reply_w, self._rows.fd)
            try:
                with self._lock:
                    if self._closing:
                        raise RuntimeError("the engine is closing")
                    self._proc = subprocess.Popen([sys.executable, "-c", _ENTRY, *map(str, fds)], pass_fds=fds, env=env)
            finally:
                os.close(request_r)  # only the child holds these ends now: their closing means what it should
                os.close(reply_w)
            self.pid = self._proc.pid
            tables = self._backend.tables()  # built (if nobody has yet) while the child imports xgrammar
            to.send_bytes(pickle.dumps(Init(tables, self._rows.layout, self._threads, self._slow_fill_s)))
            kind, _, payload = decode_reply(frm.recv_bytes())
            if kind != READY:
                raise RuntimeError(f"it failed to start:\n{payload}")
        except BaseException as exc:  # any failure leaves the step thread's matchers in charge
            for conn in conns:
                conn.close()
            if self._proc is not None:
                self._reap()
            if not self._closing:
                self.failure = RequestFailedError(f"the grammar process could not start: {exc}")
                logger.warning("%s; constrained requests keep their matchers in the step thread", self.failure)
            return
        self._to, self._from = to, frm
        if self._on_exit is not None:
            threading.Thread(target=self._watch, args=(self._proc,), name="asyncllm-grammar-watch", daemon=True).start()
        self.ready = True
        self._backend.watch(self.precompile)  # the constraints compiled lately, then each new one
        logger.info("grammar process ready (pid %d, %d filling threads)", self.pid, self._threads)

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        if not self._closing and self._on_exit is not None:
            self._on_exit()

    def _reap(self) -> int | None:
        """The worker's exit status, once it has exited (killed if it has not after `_EXIT_S`)."""
        proc = self._proc
        if proc is None:
            return None
        try:
            return proc.wait(_EXIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the grammar process (pid %d) did not exit: killing it", proc.pid)
            proc.kill()
            return proc.wait()
