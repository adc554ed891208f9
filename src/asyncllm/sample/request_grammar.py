"""`RequestGrammar`: one constrained request's xgrammar matcher and where its output stands within a UTF-8
character. Made by the runner's `GrammarTable` when the request arrives; the matcher itself is made when the
compiled grammar is first needed. Knows nothing of steps, rows or devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from asyncllm.errors import InvalidRequestError
from asyncllm.sample.grammar import GrammarBackend
from asyncllm.sample.utf8 import BOUNDARY, Utf8Table

if TYPE_CHECKING:
    import xgrammar as xgr


class RequestGrammar:
    """One request's matcher, made when its compiled grammar is first needed; `error` ends the request.
    `terminated` mirrors the matcher's own flag (it accepted a stop token), read without a call into
    xgrammar: every such call releases the GIL, and a step reads it for every constrained row."""

    __slots__ = (
        "_backend",
        "_future",
        "error",
        "field",
        "matcher",
        "stop_token_ids",
        "terminated",
        "utf8",
        "utf8_state",
    )

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
        self.stop_token_ids: frozenset[int] = frozenset(backend.stop_token_ids) if backend is not None else frozenset()
        self.terminated = False
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

    def refuse(self, token_id: int) -> str:
        """Fail the request for `token_id`, which its matcher (or UTF-8) refused: say why. The matcher is
        still where the draw found it: either its row allowed nothing (the draw then takes token 0), or
        this is a bug."""
        assert self.utf8 is not None and self.matcher is not None
        row = np.zeros(self.utf8.allowed.shape[1], dtype=np.int32)
        self.matcher.fill_next_token_bitmask(row)
        if not (row & self.utf8.allowed[self.utf8_state]).any():
            self.error = (
                f"SamplingParams.{self.field}: no token of the model's vocabulary can continue the output here "
                "(the constraint asks for text the vocabulary cannot spell as valid UTF-8, or allows none)"
            )
        else:
            self.error = f"SamplingParams.{self.field}: token {token_id} was sampled against the constraint (a bug)"
        return self.error


def accept_tokens(rows: Sequence[tuple[int, RequestGrammar]], tokens: Sequence[int]) -> dict[int, str]:
    """Feed each (row, grammar) its row's token, every matcher in one call into xgrammar; the refusals'
    errors by row. A finished or failed request's token is dropped (never output)."""
    from xgrammar import BatchGrammarMatcher  # loaded by the compile that made the matchers

    refused: dict[int, str] = {}
    live: list[tuple[int, RequestGrammar, int, int]] = []  # (row, grammar, token, UTF-8 state after it)
    for row, grammar in rows:
        if grammar.terminated or grammar.ready() is None:
            continue
        token = tokens[row]
        assert grammar.utf8 is not None
        state = int(grammar.utf8.next[grammar.utf8_state, token])
        if state < 0:
            refused[row] = grammar.refuse(token)
        else:
            live.append((row, grammar, token, state))
    if not live:
        return refused
    matchers = [grammar.matcher for _, grammar, _, _ in live]
    accepted = BatchGrammarMatcher.batch_accept_token(matchers, [token for _, _, token, _ in live])  # type: ignore[arg-type]
    for (row, grammar, token, state), ok in zip(live, accepted):
        if not ok:
            refused[row] = grammar.refuse(token)
            continue
        grammar.utf8_state = state
        if token in grammar.stop_token_ids:  # the matcher accepted a stop token: it has terminated
            grammar.terminated = True
    return refused
