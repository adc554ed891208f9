"""Structured output in the runner: the constrained requests' grammars (`RequestGrammar`), and per step the
token bitmask of the constrained rows it samples.

A step's masks are mostly filled before its draw is due: when a constrained step's tokens are read (by the
core, or by the next fill where nobody reads, as on tensor-parallel workers), its `FillJob`
(`mask_fill.py`) takes them to the matchers and starts filling each of its requests' next row. So `plan`
(when a step's inputs are staged) points each constrained row at the row the last job fills for its
request, or at a row of its own after those for a request the job did not cover (new, or one that skipped
a step); `fill` (just before the draw) waits for that job, fills those few, and uploads the lot; `sent`
makes the step's own job. The matchers see every token in order: a job accepts only after the previous
one's rows were drawn from. Knows nothing of models or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.sample.grammar import GrammarBackend
from asyncllm.sample.mask_fill import (
    BatchFill,
    ConstrainedStep,
    DeviceMasks,
    Filler,
    FillJob,
    HostRows,
)
from asyncllm.sample.request_grammar import RequestGrammar
from asyncllm.sample.state import SamplingState
from asyncllm.step import StepResult

__all__ = ["GrammarTable", "MaskPlan", "RequestGrammar", "TokenMask"]


@dataclass
class TokenMask:
    """What the sampler applies: bitmask row `mask_rows[r]` to logits row r (-1: unconstrained)."""

    bitmask: torch.Tensor  # [C, W] int32 on the device, xgrammar's layout (bit t % 32 of word t // 32)
    mask_rows: torch.Tensor  # [S] int64 on the device


@dataclass
class MaskPlan:
    """Where a step's constrained rows find their masks (`GrammarTable.plan`)."""

    rows: list[int]  # each sampled row's bitmask row, -1 where unconstrained: staged with the step's inputs
    source: FillJob | None  # the job whose rows [0, len(source.grammars)) the step reuses
    extras: list[tuple[int, RequestGrammar]]  # rows filled at `fill`, for requests the job did not cover
    constrained: list[tuple[int, RequestGrammar]]  # (sampled row, its grammar), in row order
    num_rows: int  # bitmask rows uploaded


class GrammarTable:
    """The runner's constrained requests: `add`/`remove` them; per constrained step `plan`, `fill`, `sent`."""

    def __init__(self, backend: GrammarBackend | None, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.backend = backend
        self.device = device
        self._max_rows = max_rows
        self._words = -(-vocab_size // 32)
        self._stop_row = np.zeros(self._words, dtype=np.int32)  # the stop tokens alone, as a bitmask row
        for token in backend.stop_token_ids if backend is not None else ():
            self._stop_row[token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))
        self._num_live = 0  # requests with a grammar: while none, a step looks at no state
        self._last: FillJob | None = None  # the last constrained step's job
        # Allocated at the first constrained step: two sets of host rows that jobs alternate between (a job
        # fills one while the other's upload may still be in flight), each with room for a job's rows and
        # as many more; the device's rows; xgrammar's batch filler.
        self._hosts: list[HostRows] = []
        self._flip = 0
        self._device_masks: DeviceMasks | None = None
        self._fill: Filler | None = None

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

    def plan(self, states: list[SamplingState]) -> MaskPlan | None:
        """Each sampled row's bitmask row; None when no row is constrained. Known before the forward pass."""
        if not self._num_live:
            return None
        source = self._last
        index = source.index if source is not None else {}
        base = len(index)
        rows: list[int] = []
        extras: list[tuple[int, RequestGrammar]] = []
        constrained: list[tuple[int, RequestGrammar]] = []
        for i, state in enumerate(states):
            grammar = state.grammar
            if grammar is None:
                rows.append(-1)
                continue
            row = index.get(grammar)
            if row is None:
                row = base + len(extras)
                extras.append((row, grammar))
            rows.append(row)
            constrained.append((i, grammar))
        if not constrained:
            return None
        return MaskPlan(rows, source, extras, constrained, base + len(extras))

    def fill(self, plan: MaskPlan, mask_rows: torch.Tensor) -> tuple[TokenMask, dict[int, str] | None]:
        """The step's bitmask, uploaded (the plan's job has filled its rows; the extras are filled here);
        and the rows whose request cannot go on, by row (its constraint failed to compile, or before)."""
        device_masks = self._buffers()
        if plan.source is not None:
            plan.source.accept()  # its rows filled (here, if nobody read its step), the matchers past its tokens
            host = plan.source.host
        else:
            host = self._hosts[self._flip]
            host.writable()
        if plan.extras:
            matchers, rows = host.prepare(plan.extras, self._stop_row)
            if matchers:
                self._batch_fill()(matchers, host.bits, rows)
        failed = {i: grammar.error for i, grammar in plan.constrained if grammar.error is not None}
        return TokenMask(device_masks.upload(host, plan.num_rows), mask_rows), failed or None

    def sent(self, result: StepResult, plan: MaskPlan) -> StepResult:
        """The step `plan` masked was sampled: start its job, and return its result as the job gives it."""
        self._flip ^= 1
        job = FillJob(result, plan.constrained, self._hosts[self._flip], self._stop_row, self._batch_fill())
        self._last = job
        return ConstrainedStep(result, job)

    def _batch_fill(self) -> BatchFill:
        """xgrammar's batch filler: one, as fills never overlap (a job's fill ends before the next fill)."""
        if self._fill is None:
            self._fill = Filler()
        return self._fill

    def _buffers(self) -> DeviceMasks:
        if self._device_masks is None:
            rows, pin = 2 * self._max_rows, self.device.type == "cuda"
            self._hosts = [HostRows(rows, self._words, pin) for _ in range(2)]
            # Without a backend every constrained request fails at its first step: any UTF-8 table will do.
            utf8 = self.backend.utf8.allowed if self.backend is not None else np.full((8, self._words), -1, np.int32)
            self._device_masks = DeviceMasks(rows, self._words, utf8, self.device)
        return self._device_masks
