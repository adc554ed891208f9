"""The `StepResult`s of a sampling step beyond its ids' copy (`sampled_outputs.py`): a draw held on the host
until its masks are filled (`HeldDraw`), and a constrained step's read (`ConstrainedRead`), where the grammar
takes the step's tokens. Knows nothing of models or sampling: the runner hands it what to call.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncllm.step import ModelRunnerOutput, StepResult
from asyncllm.structured_output.grammar_table import GrammarTable
from asyncllm.structured_output.mask_fill import FillJob


class HeldDraw:
    """A step whose draw waits on the host for its bitmask: `start()` fills the mask and launches the draw
    (once; the runner does it at the next submit), `result()` starts it if nobody has, then waits."""

    __slots__ = ("_draw", "_error", "_sent")

    def __init__(self, draw: Callable[[], StepResult]) -> None:
        self._draw: Callable[[], StepResult] | None = draw
        self._sent: StepResult | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        if self._draw is not None:
            draw, self._draw = self._draw, None
            try:
                self._sent = draw()
            except BaseException as exc:  # whoever reads the result later gets it too
                self._error = exc
                raise

    def done(self) -> bool:
        return self._error is not None or (self._sent is not None and self._sent.done())

    def result(self) -> ModelRunnerOutput:
        self.start()
        if self._error is not None:
            raise self._error
        assert self._sent is not None
        return self._sent.result()


class ConstrainedRead:
    """A constrained step as the core reads it: its tokens go to the grammar (`GrammarTable.advance`: the
    matchers take them and fill the next step's masks) before its output goes up, with the refusals and the
    forced runs the matchers found. The read is the right moment: the next step is already launched, and
    its draw is due only after this step's tokens are known."""

    __slots__ = ("_grammars", "_job", "_sent")

    def __init__(self, sent: StepResult, job: FillJob, grammars: GrammarTable) -> None:
        self._sent = sent
        self._job = job  # reads `sent` itself where nobody reads this (a tensor-parallel worker)
        self._grammars = grammars

    def done(self) -> bool:
        return self._sent.done()

    def start(self) -> None:
        self._sent.start()

    def result(self) -> ModelRunnerOutput:
        return self._grammars.advance(self._job)
