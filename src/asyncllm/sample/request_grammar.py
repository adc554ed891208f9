"""`RequestGrammar`: one constrained request's xgrammar matcher and where its output stands within a UTF-8
character. Made by the runner's `GrammarTable` when the request arrives; the matcher itself is made when the
compiled grammar is first needed. Knows nothing of steps, rows or devices.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from asyncllm.errors import InvalidRequestError
from asyncllm.sample.grammar import GrammarBackend
from asyncllm.sample.utf8 import BOUNDARY, Utf8Table

if TYPE_CHECKING:
    import xgrammar as xgr


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
