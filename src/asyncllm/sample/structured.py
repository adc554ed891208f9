"""Structured output in the runner: each constrained request's grammar matcher, and the token bitmask of a
step's constrained rows.

A request with a constraint gets a `RequestGrammar` (`GrammarTable.add`): its grammar compiled off the
step's path (a cache hit when the front compiled it first) and an xgrammar matcher, which must have accepted
every token the request sampled before its next row can be masked. Per constrained step: `fill` writes the
rows' grammar masks on the host (xgrammar's threads) and uploads them in one copy; on the device each row
is then ANDed with the UTF-8 table's row for where its output stands within a character (`utf8.py`), so
the host never touches the vocabulary-wide rows again. `sent` wraps the step's result: whoever reads it
first (the core, or the next step's `settle` where nobody reads, as on tensor-parallel workers) feeds the
sampled tokens to the matchers, and a token a matcher refuses (a row the mask left empty draws token 0)
fails its request in that same output, so no such token is ever emitted. Knows nothing of models or
scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncllm.errors import InvalidRequestError
from asyncllm.sample.grammar import GrammarBackend
from asyncllm.sample.state import SamplingState
from asyncllm.sample.utf8 import BOUNDARY, Utf8Table
from asyncllm.step import ModelRunnerOutput, StepResult

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass
class TokenMask:
    """What the sampler applies: bitmask row `mask_rows[r]` to logits row r (-1: unconstrained)."""

    bitmask: torch.Tensor  # [C, W] int32 on the device, xgrammar's layout (bit t % 32 of word t // 32)
    mask_rows: torch.Tensor  # [S] int64 on the device


class RequestGrammar:
    """One request's matcher, made when its compiled grammar is first needed; `error` ends the request."""

    __slots__ = ("_backend", "_future", "error", "field", "matcher", "utf8", "utf8_state")

    def __init__(
        self,
        field: str,
        backend: GrammarBackend | None,
        future: Future[xgr.CompiledGrammar] | None,
        error: str | None = None,
    ) -> None:
        self.field = field
        self._backend = backend
        self._future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.utf8: Utf8Table | None = None
        self.utf8_state = BOUNDARY  # where the output's bytes stand within a character
        self.error = error

    def ready(self) -> xgr.GrammarMatcher | None:
        """The matcher (waiting for the compile if it is still running); None once the request failed."""
        if self.matcher is None and self.error is None:
            assert self._future is not None and self._backend is not None
            from xgrammar import GrammarMatcher  # loaded by the compile that produced the future

            try:
                self.matcher = GrammarMatcher(self._future.result())
                self.utf8 = self._backend.utf8
            except InvalidRequestError as exc:  # a request that reached the core without the front's check
                self.error = str(exc)
            self._future = None
        return None if self.error is not None else self.matcher

    def accept(self, token_id: int) -> str | None:
        """Feed a sampled token; the request's error if the matcher (or UTF-8) refuses it."""
        matcher = self.ready()
        if matcher is None or matcher.is_terminated():  # finished: a token sampled after it is dropped
            return None
        assert self.utf8 is not None
        state = self.utf8.advance(self.utf8_state, token_id)
        if state < 0 or not matcher.accept_token(token_id):
            self.error = self._refusal(matcher, token_id)
            return self.error
        self.utf8_state = state
        return None

    def _refusal(self, matcher: xgr.GrammarMatcher, token_id: int) -> str:
        """Why `token_id` was drawn against the constraint: its row allowed nothing (the draw then takes
        token 0), or a bug. The matcher is still where the draw found it."""
        assert self.utf8 is not None
        row = np.zeros(self.utf8.allowed.shape[1], dtype=np.int32)
        matcher.fill_next_token_bitmask(row)
        if not (row & self.utf8.allowed[self.utf8_state]).any():
            return (
                f"SamplingParams.{self.field}: no token of the model's vocabulary can continue the output here "
                "(the constraint asks for text the vocabulary cannot spell as valid UTF-8, or allows none)"
            )
        return f"SamplingParams.{self.field}: token {token_id} was sampled against the constraint (a bug)"


class GrammarTable:
    """The runner's constrained requests: `add`/`remove` them; per step `mask_rows`, `settle`, `fill`, `sent`."""

    def __init__(self, backend: GrammarBackend | None, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.backend = backend
        self.device = device
        self._max_rows = max_rows
        self._words = -(-vocab_size // 32)
        self._buffers: _MaskBuffers | None = None  # allocated at the first constrained step
        self._stop_row = np.zeros(self._words, dtype=np.int32)  # the stop tokens alone, as a bitmask row
        for token in backend.stop_token_ids if backend is not None else ():
            self._stop_row[token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))
        # The last constrained step, until its tokens reach the matchers.
        self._pending: ConstrainedStep | None = None
        self._num_live = 0  # requests with a grammar: while none, a step looks at no state
        self._batch: xgr.BatchGrammarMatcher | None = None

    def add(self, state: SamplingState) -> None:
        spec = state.params.structured
        if spec is None:
            return
        if self.backend is None:
            error = f"SamplingParams.{spec.field} needs the model's tokenizer and EOS ids, and this engine lacks them"
            state.grammar = RequestGrammar(spec.field, None, None, error)
        else:
            state.grammar = RequestGrammar(spec.field, self.backend, self.backend.compile_async(spec))
        self._num_live += 1

    def remove(self, state: SamplingState) -> None:
        if state.grammar is not None:
            state.grammar = None
            self._num_live -= 1

    def mask_rows(self, states: Sequence[SamplingState]) -> list[int] | None:
        """Each sampled row's bitmask row (constrained rows numbered in order) or -1; None when no row is
        constrained. Known before the forward pass, so the runner stages it with the step's inputs."""
        if not self._num_live:
            return None
        rows, n = [], 0
        for state in states:
            if state.grammar is None:
                rows.append(-1)
            else:
                rows.append(n)
                n += 1
        return rows if n else None

    def settle(self) -> None:
        """Feed the last constrained step's tokens to their matchers, unless its result was read already
        (waits for that step)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def fill(self, states: Sequence[SamplingState], mask_rows: torch.Tensor) -> tuple[TokenMask, dict[int, str] | None]:
        """The step's bitmask (after `settle`), uploaded and ANDed with each row's UTF-8 row on the device;
        and the rows whose request cannot go on, by row (its constraint failed to compile, or failed before)."""
        buffers = self._mask_buffers()
        host_np, utf8_np = buffers.wait_host()
        constrained: list[tuple[int, RequestGrammar]] = []  # (batch row, its grammar), in bitmask-row order
        to_fill: list[tuple[xgr.GrammarMatcher, int]] = []  # (matcher, bitmask row)
        for i, state in enumerate(states):
            grammar = state.grammar
            if grammar is None:
                continue
            n = len(constrained)
            constrained.append((i, grammar))
            utf8_np[n] = grammar.utf8_state
            matcher = grammar.ready()
            if matcher is None:
                host_np[n] = -1  # any token: a failed request's is never output
            elif matcher.is_terminated():
                host_np[n] = self._stop_row  # complete: EOS alone (its request has ended; the token is dropped)
            else:
                to_fill.append((matcher, n))
        if to_fill:  # xgrammar fills the rows on its threads, without the GIL
            matchers, rows = [m for m, _ in to_fill], [n for _, n in to_fill]
            self._batch_matcher().batch_fill_next_token_bitmask(matchers, buffers.host, rows)
        failed = {i: grammar.error for i, grammar in constrained if grammar.error is not None}
        return TokenMask(buffers.upload(len(constrained)), mask_rows), failed or None

    def sent(self, result: StepResult, states: Sequence[SamplingState]) -> StepResult:
        """The step whose rows `fill` masked was sampled: its result, whose first reader feeds the tokens to
        the matchers (the next `settle` at the latest)."""
        step = ConstrainedStep(result, [(i, s.grammar) for i, s in enumerate(states) if s.grammar is not None])
        self._pending = step
        return step

    def _batch_matcher(self) -> xgr.BatchGrammarMatcher:
        if self._batch is None:
            from xgrammar import BatchGrammarMatcher  # loaded by the compile of the grammars it fills for

            self._batch = BatchGrammarMatcher()
        return self._batch

    def _mask_buffers(self) -> _MaskBuffers:
        if self._buffers is None:
            assert self.backend is not None  # a constrained row without a backend fails before any fill
            self._buffers = _MaskBuffers(self._max_rows, self._words, self.backend.utf8.allowed, self.device)
        return self._buffers


class ConstrainedStep:
    """A constrained step's result: the first `result()` feeds its tokens to the matchers, and a token one
    refuses fails its request in this same output (the core drops a failed request's token)."""

    __slots__ = ("_inner", "_output", "_rows")

    def __init__(self, inner: StepResult, rows: list[tuple[int, RequestGrammar]]) -> None:
        self._inner = inner
        self._rows = rows
        self._output: ModelRunnerOutput | None = None

    def done(self) -> bool:
        return self._output is not None or self._inner.done()

    def start(self) -> None:
        self._inner.start()

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            output = self._inner.result()
            tokens = output.sampled_token_ids
            refused = {}
            for row, grammar in self._rows:
                error = grammar.accept(tokens[row])
                if error is not None:
                    refused[row] = error
            if refused:
                output = replace(output, failed={**(output.failed or {}), **refused})
            self._output = output
        return self._output


class _MaskBuffers:
    """The bitmask rows and their UTF-8 states on the host (pinned on CUDA) and their device twins, with the
    UTF-8 table resident on the device."""

    def __init__(self, max_rows: int, words: int, utf8_allowed: np.ndarray, device: torch.device) -> None:
        pin = device.type == "cuda"
        with torch.inference_mode(False):
            self.host = torch.zeros((max_rows, words), dtype=torch.int32, pin_memory=pin)
            self.host_states = torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin)
            self.dev = torch.zeros((max_rows, words), dtype=torch.int32, device=device)
            self.dev_states = torch.zeros(max_rows, dtype=torch.int64, device=device)
            self.utf8 = torch.from_numpy(np.ascontiguousarray(utf8_allowed[:, :words])).to(device)
        self._host_np = self.host.numpy()
        self._states_np = self.host_states.numpy()
        self._copied = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]

    def wait_host(self) -> tuple[np.ndarray, np.ndarray]:
        """The host rows and states, once the last upload has read them (long done: the matchers waited for
        a later point of the stream)."""
        if self._copied is not None and not self._copied.query():  # type: ignore[no-untyped-call]
            self._copied.synchronize()
        return self._host_np, self._states_np

    def upload(self, n: int) -> torch.Tensor:
        """Rows [0, n) to the device, each ANDed there with its state's UTF-8 row: the step's bitmask."""
        dev = self.dev[:n]
        dev.copy_(self.host[:n], non_blocking=True)
        states = self.dev_states[:n]
        states.copy_(self.host_states[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        dev.bitwise_and_(self.utf8.index_select(0, states))
        return dev
