"""The masks of constrained rows, filled ahead: when a constrained step's tokens are read on the host (by the
core, before it turns them into outputs), its `FillJob` feeds them to the requests' matchers and fills each
request's next bitmask row, so the next step's draw finds its rows ready. Each is one call into xgrammar
(every call releases the GIL: one per step, not one per row). `HostRows` are the rows it fills (pinned, two
sets that alternate between jobs); `DeviceMasks` uploads them and ANDs each row with its UTF-8 table row on
the device. Knows nothing of models or scheduling: rows are numbered by whoever plans the step.

Measured on the H200 (bench/RESULTS.md, runs 40-47): waiting for the fill on a helper thread, to overlap it
with the core's work, gained nothing measurable over filling here, so there is no helper.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from asyncllm.sample.request_grammar import RequestGrammar, accept_tokens
from asyncllm.step import ModelRunnerOutput, StepResult

if TYPE_CHECKING:
    import xgrammar as xgr


# xgrammar starts its threads anew on every batch call (0.1-1 ms): fewer rows than this are filled on one.
PARALLEL_MIN_ROWS = 16


class BatchFill(Protocol):
    """Fills the bitmask rows `indices` of `bitmask` with the matchers' next masks."""

    def __call__(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor, indices: list[int]) -> None: ...


class Filler:
    """xgrammar's batch fill, its thread count chosen per call: fewer than `PARALLEL_MIN_ROWS` rows on one
    thread, more on most of the host's cores (the step thread and the device's driver keep two)."""

    def __init__(self) -> None:
        from xgrammar import BatchGrammarMatcher  # loaded by the compile of the grammars it fills for

        self._one = BatchGrammarMatcher(max_threads=1)
        self._many = BatchGrammarMatcher(max_threads=max(1, min(16, len(os.sched_getaffinity(0)) - 2)))

    def __call__(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor, indices: list[int]) -> None:
        batch = self._many if len(matchers) >= PARALLEL_MIN_ROWS else self._one
        batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)


class HostRows:
    """Bitmask rows and each row's UTF-8 state on the host (pinned on CUDA); `writable()` waits until the
    last upload from them has read them."""

    def __init__(self, rows: int, words: int, pin: bool) -> None:
        with torch.inference_mode(False):
            self.bits = torch.zeros((rows, words), dtype=torch.int32, pin_memory=pin)
            self.states = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
        self.bits_np = self.bits.numpy()
        self.states_np = self.states.numpy()
        self.copied = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]

    def writable(self) -> None:
        if self.copied is not None and not self.copied.query():  # type: ignore[no-untyped-call]
            self.copied.synchronize()

    def prepare(
        self, entries: Iterable[tuple[int, RequestGrammar]], stop_row: np.ndarray
    ) -> tuple[list[xgr.GrammarMatcher], list[int]]:
        """Row r of each (r, grammar) set where no matcher needs to run (after `writable()`): the rows
        xgrammar must fill, with their matchers, are returned."""
        matchers: list[xgr.GrammarMatcher] = []
        rows: list[int] = []
        for row, grammar in entries:
            self.states_np[row] = grammar.utf8_state
            matcher = grammar.ready()
            if matcher is None:
                self.bits_np[row] = -1  # any token: a failed request's is never output
            elif grammar.terminated:
                self.bits_np[row] = stop_row  # complete: EOS alone (its request has ended; the token is dropped)
            else:
                matchers.append(matcher)
                rows.append(row)
        return matchers, rows


class DeviceMasks:
    """The device's bitmask rows and states, and the vocabulary's UTF-8 table, resident."""

    def __init__(self, rows: int, words: int, utf8_allowed: np.ndarray, device: torch.device) -> None:
        with torch.inference_mode(False):
            self.bits = torch.zeros((rows, words), dtype=torch.int32, device=device)
            self.states = torch.zeros(rows, dtype=torch.int64, device=device)
            self.utf8 = torch.from_numpy(np.ascontiguousarray(utf8_allowed[:, :words])).to(device)

    def upload(self, host: HostRows, n: int) -> torch.Tensor:
        """Rows [0, n) to the device, each ANDed there with its state's UTF-8 row: the step's bitmask."""
        bits, states = self.bits[:n], self.states[:n]
        bits.copy_(host.bits[:n], non_blocking=True)
        states.copy_(host.states[:n], non_blocking=True)
        if host.copied is not None:
            host.copied.record()
        bits.bitwise_and_(self.utf8.index_select(0, states))
        return bits


class FillJob:
    """One constrained step's follow-up: `accept()` feeds its tokens to its requests' matchers (a token one
    refuses fails that request in this step's own output), then fills each request's next row in `host`
    (row i for `grammars[i]`); the next fill calls `accept()` itself where nobody read the step's result (on
    a tensor-parallel worker)."""

    def __init__(
        self,
        step: StepResult,
        rows: list[tuple[int, RequestGrammar]],
        host: HostRows,
        stop_row: np.ndarray,
        fill: BatchFill,
    ) -> None:
        self.grammars = [grammar for _, grammar in rows]
        self.index = {grammar: i for i, grammar in enumerate(self.grammars)}
        self.host = host
        self._step = step
        self._rows = rows
        self._stop_row = stop_row
        self._fill = fill
        self._output: ModelRunnerOutput | None = None

    def accept(self) -> ModelRunnerOutput:
        """The step's output with the matchers' refusals (waits for the step); the rows are filled here."""
        if self._output is None:
            output = self._step.result()
            refused = accept_tokens(self._rows, output.sampled_token_ids)
            if refused:
                output = replace(output, failed={**(output.failed or {}), **refused})
            self._output = output
            self.host.writable()
            matchers, rows = self.host.prepare(enumerate(self.grammars), self._stop_row)
            if matchers:
                self._fill(matchers, self.host.bits, rows)
        return self._output


class ConstrainedStep:
    """A constrained step's result: its output once the matchers have taken its tokens (`FillJob.accept`)."""

    __slots__ = ("_inner", "_job")

    def __init__(self, inner: StepResult, job: FillJob) -> None:
        self._inner = inner
        self._job = job

    def done(self) -> bool:
        return self._inner.done()

    def start(self) -> None:
        self._inner.start()

    def result(self) -> ModelRunnerOutput:
        return self._job.accept()
