"""The grammar process's side (`python -c "from asyncllm.structured_output.grammar_worker import main; main()"`): it
holds the constrained requests' matchers (`MatcherSet`, compiled with its own `GrammarBackend` made of the
engine's vocabulary tables), takes each step's tokens and writes the next bitmask rows straight into the
shared rows, while the engine's step thread does its own host work. A step's rows are split over a few
threads of its own, each accepting and filling its share in single calls into xgrammar (which release the
GIL), so the work spreads over cores without starting threads per step. Ends when the engine's end of the
request pipe closes (the engine shut down or died). Knows nothing of devices, models or scheduling.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import numpy as np

from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.draft_fill import accept_runs, fill_after_drafts
from asyncllm.structured_output.fill_costs import FillCosts, TimedRows
from asyncllm.structured_output.grammar_wire import (
    ACCEPTED,
    DRAFTS,
    FAILED,
    FILL,
    FILLED,
    OPS,
    READY,
    SLOW,
    STEP,
    Init,
    Request,
    decode_request,
    encode_reply,
)
from asyncllm.structured_output.host_rows import RowsSegment
from asyncllm.structured_output.matcher_set import BatchFill, MatcherSet

# A share smaller than this goes with another: a thread's hand-off costs more than filling a few rows.
MIN_ROWS_PER_THREAD = 16


class GrammarWorker:
    """Serves requests until the pipe closes: `serve(requests, replies)`."""

    def __init__(
        self,
        backend: GrammarBackend,
        sets: list[tuple[np.ndarray, np.ndarray]],
        threads: int,
        flags: np.ndarray | None = None,
        slow_fill_s: float | None = None,
    ) -> None:
        """`flags`: the sets' flags, where requests' marks go (None: marks are ignored). `slow_fill_s`: each
        slot's accepts and fills are timed, and a slot whose average passes it is reported (SLOW): the engine
        sends later requests with its constraint to its slow lane (None: not timed)."""
        from xgrammar import BatchGrammarMatcher

        self._backend = backend
        self.matchers = MatcherSet(backend, sets[0][0].shape[1])
        self._sets = sets
        self._flags = flags
        self._threads = max(1, threads)
        # One single-threaded batch filler per share: xgrammar's own multi-threaded one starts its threads
        # anew on every call.
        self._fills: list[BatchFill] = [
            BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask for _ in range(self._threads)
        ]
        self._pool = ThreadPoolExecutor(self._threads - 1) if self._threads > 1 else None
        self._costs = FillCosts(slow_fill_s) if slow_fill_s is not None else None
        if self._costs is not None:
            self.matchers.timer = TimedRows()

    def serve(self, requests: Connection, replies: Connection) -> None:
        while True:
            try:
                data = requests.recv_bytes()
            except EOFError:
                return
            request = decode_request(data)
            for op in request.ops:
                if op[0] == "add":
                    self.matchers.add(op[1], op[2])  # type: ignore[misc]
                elif op[0] == "remove":
                    self.matchers.remove(op[1])
                    if self._costs is not None:
                        self._costs.forget(op[1])
                else:  # compile ahead: the add that follows finds it compiled (or compiling)
                    self._backend.compile_async(op[2])  # type: ignore[misc]
            if request.kind == OPS:
                continue
            errors: dict[int, str] = {}
            if request.kind == STEP:
                errors = self._step(request, replies)
            elif request.kind == FILL:
                errors = self._fill(request)
            elif request.kind == DRAFTS:
                self._drafts(request)
            self._mark(request)  # the device may read the rows now: it need not wait for the reply's trip
            if self._costs is not None and self.matchers.timer is not None:
                slow = self._costs.observe(*self.matchers.timer.take())
                if slow:
                    replies.send_bytes(encode_reply(SLOW, request.seq, dict.fromkeys(slow, "")))
            replies.send_bytes(encode_reply(FILLED, request.seq, errors))

    def _mark(self, request: Request) -> None:
        # The rows' stores (this thread's, and the filling threads', joined) are made before this one; x86
        # keeps stores in order, so whoever sees the flag sees the rows.
        if request.mark and self._flags is not None:
            self._flags[request.set] = request.mark

    def _step(self, request: Request, replies: Connection) -> dict[int, str]:
        rows, slots, tokens = request.rows.tolist(), request.slots.tolist(), request.tokens
        assert tokens is not None
        # A verified step's accepted tokens before each slot's last: the engine's rows were filled after them.
        led = accept_runs(self.matchers, slots, request.leads) if request.leads else {}
        if request.verdict:  # the engine waits for the refusals: accept every token first
            refused = {**led, **self.matchers.accept(slots, tokens.tolist())}
            replies.send_bytes(encode_reply(ACCEPTED, request.seq, refused))
            return self._fill(request)
        bits, states = self._sets[request.set]
        refused, errors = self.matchers.step(bits, states, rows, slots, tokens.tolist(), self._spread)
        return {**led, **refused, **errors}

    def _drafts(self, request: Request) -> None:
        """Each drafting slot's rows (a run of the request's rows with one slot), filled after its drafts."""
        bits, states = self._sets[request.set]
        rows, slots = request.rows.tolist(), request.slots.tolist()
        assert request.tokens is not None
        tokens = request.tokens.tolist()
        start, timer = 0, self.matchers.timer
        for end in range(1, len(rows) + 1):
            if end == len(rows) or slots[end] != slots[start]:
                began = time.thread_time()
                fill_after_drafts(self.matchers, bits, states, slots[start], rows[start:end], tokens[start:end])
                if timer is not None:  # a row's cost, as its own rows' (the message's sample of it)
                    timer.spread([slots[start]], (time.thread_time() - began) / (end - start))
                start = end

    def _fill(self, request: Request) -> dict[int, str]:
        bits, states = self._sets[request.set]
        return self.matchers.fill(bits, states, request.rows.tolist(), request.slots.tolist(), self._spread)

    def _spread(self, n: int, share: Callable[[BatchFill, int, int], None]) -> None:
        """share(fill_k, lo, hi) over [0, n) in up to `threads` contiguous parts, the last on this thread."""
        if not n:
            return
        parts = max(1, min(self._threads, n // MIN_ROWS_PER_THREAD))
        bounds = [n * k // parts for k in range(parts + 1)]
        pool = self._pool
        assert pool is not None or parts == 1
        fills = self._fills
        futures = [pool.submit(share, fills[k], bounds[k], bounds[k + 1]) for k in range(parts - 1)] if pool else []
        share(self._fills[parts - 1], bounds[parts - 1], bounds[parts])
        for future in futures:
            future.result()


def main() -> None:
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the engine decides when this
    # process ends (it closes the pipe), after draining the requests whose matchers live here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    request_fd, reply_fd, rows_fd = (int(arg) for arg in sys.argv[1:4])
    requests, replies = Connection(request_fd, writable=False), Connection(reply_fd, readable=False)
    try:
        init: Init = pickle.loads(requests.recv_bytes())
        segment = RowsSegment.attach(rows_fd, init.layout)
        views = init.layout.views(segment.buffer)
        backend = GrammarBackend.from_tables(init.tables)
        worker = GrammarWorker(backend, views, init.threads, segment.flags, init.slow_fill_s)
    except EOFError:
        return
    except BaseException:
        replies.send_bytes(encode_reply(FAILED, 0, traceback.format_exc()))
        raise SystemExit(1) from None
    replies.send_bytes(encode_reply(READY, os.getpid()))
    try:
        worker.serve(requests, replies)
    except BaseException:
        with contextlib.suppress(OSError):  # the engine is gone
            replies.send_bytes(encode_reply(FAILED, 0, traceback.format_exc()))
        raise SystemExit(1) from None
