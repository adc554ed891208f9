"""Structured output in the runner: each constrained request's grammar matcher, and the token bitmask of a
step's constrained rows.

A request with a constraint gets a `RequestGrammar` (`GrammarTable.add`): its grammar compiled off the
step's path (a cache hit when the front compiled it first) and an xgrammar matcher, which must have accepted
every token the request sampled before its next row can be masked; the row also keeps the output valid
UTF-8 (`utf8.py`). With overlapped scheduling the previous step's tokens are still on the device when a step
is submitted, so the runner asks for masks only after it has launched the step's forward pass: `settle`
waits for the previous step's output (the `StepResult`, whose `result()` is cached, so the core's own read
later costs nothing) and feeds the matchers, `fill` writes the rows on the host and uploads them in one
copy. A step that samples no constrained row does none of this. Knows nothing of models or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncllm.errors import InvalidRequestError
from asyncllm.sample.grammar import GrammarBackend
from asyncllm.sample.state import SamplingState
from asyncllm.sample.utf8 import BOUNDARY, Utf8Table
from asyncllm.step import StepResult

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

    def accept(self, token_id: int) -> None:
        matcher = self.ready()
        if matcher is None or matcher.is_terminated():  # finished: a token sampled after it is dropped
            return
        assert self.utf8 is not None
        state = self.utf8.advance(self.utf8_state, token_id)
        if state < 0 or not matcher.accept_token(token_id):
            self.error = f"SamplingParams.{self.field}: token {token_id} was sampled against the constraint (a bug)"
        self.utf8_state = state


class GrammarTable:
    """The runner's constrained requests: `add`/`remove` them; per step `mask_rows`, `settle`, `fill`, `sent`."""

    def __init__(self, backend: GrammarBackend | None, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.backend = backend
        self.device = device
        self._max_rows = max_rows
        self._words = -(-vocab_size // 32)
        # The host rows (pinned on CUDA) and their device twin, allocated at the first constrained step.
        self._host: torch.Tensor | None = None
        self._host_np: np.ndarray | None = None
        self._dev: torch.Tensor | None = None
        self._stop_row = np.zeros(self._words, dtype=np.int32)  # the stop tokens alone, as a bitmask row
        for token in backend.stop_token_ids if backend is not None else ():
            self._stop_row[token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        # The last sampling step's constrained rows, whose tokens the matchers have not accepted yet.
        self._pending: tuple[StepResult, list[tuple[int, RequestGrammar]]] | None = None
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
        """Feed the last sampling step's constrained tokens to their matchers (waits for that step)."""
        if self._pending is None:
            return
        result, rows = self._pending
        self._pending = None
        tokens = result.result().sampled_token_ids
        for row, grammar in rows:
            grammar.accept(tokens[row])

    def fill(self, states: Sequence[SamplingState], mask_rows: torch.Tensor) -> tuple[TokenMask, dict[int, str] | None]:
        """The step's bitmask (after `settle`), uploaded; and the rows whose request cannot go on, by row:
        its constraint failed to compile, or allows no token of the vocabulary here."""
        host, host_np, dev = self._buffers()
        # The last upload has read the host rows: long done, as `settle` waited for a later point of the stream.
        if self._copied is not None and not self._copied.query():  # type: ignore[no-untyped-call]
            self._copied.synchronize()
        constrained: list[tuple[int, RequestGrammar]] = []  # (batch row, its grammar), in bitmask-row order
        to_fill: list[tuple[xgr.GrammarMatcher, int, RequestGrammar]] = []  # (matcher, bitmask row, grammar)
        for i, state in enumerate(states):
            grammar = state.grammar
            if grammar is None:
                continue
            n = len(constrained)
            constrained.append((i, grammar))
            matcher = grammar.ready()
            if matcher is None:
                host_np[n] = -1  # any token: a failed request's is never output
            elif matcher.is_terminated():
                host_np[n] = self._stop_row  # complete: EOS alone (its request has ended; the token is dropped)
            else:
                to_fill.append((matcher, n, grammar))
        if to_fill:  # xgrammar fills the rows on its threads, without the GIL
            self._batch_matcher().batch_fill_next_token_bitmask(
                [m for m, _, _ in to_fill], host, [n for _, n, _ in to_fill]
            )
        for _, n, grammar in to_fill:
            assert grammar.utf8 is not None
            host_np[n] &= grammar.utf8.allowed[grammar.utf8_state]
            if not host_np[n].any():
                grammar.error = (
                    f"SamplingParams.{grammar.field}: no token of the model's vocabulary can continue the output "
                    "here (the constraint asks for text the vocabulary cannot spell as valid UTF-8, or allows none)"
                )
        failed = {i: grammar.error for i, grammar in constrained if grammar.error is not None}
        n = len(constrained)
        dev[:n].copy_(host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return TokenMask(dev[:n], mask_rows), failed or None

    def sent(self, result: StepResult, states: Sequence[SamplingState]) -> None:
        """The step whose rows `fill` masked was sampled: its tokens go to the matchers at the next `settle`."""
        rows = [(i, s.grammar) for i, s in enumerate(states) if s.grammar is not None]
        self._pending = (result, rows)

    def _batch_matcher(self) -> xgr.BatchGrammarMatcher:
        if self._batch is None:
            from xgrammar import BatchGrammarMatcher  # loaded by the compile of the grammars it fills for

            self._batch = BatchGrammarMatcher()
        return self._batch

    def _buffers(self) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        if self._host is None:
            shape = (self._max_rows, self._words)
            with torch.inference_mode(False):
                self._host = torch.zeros(shape, dtype=torch.int32, pin_memory=self.device.type == "cuda")
                self._dev = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._host_np = self._host.numpy()
        assert self._host_np is not None and self._dev is not None
        return self._host, self._host_np, self._dev
