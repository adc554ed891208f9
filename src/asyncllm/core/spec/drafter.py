"""`Drafter`: what the scheduler asks of a speculative method that drafts on the host (ngram.py, suffix.py).

`propose` is called for a speculative request's decode with its tokens so far (prompt and output, the last one
included) and how many drafts fit; `forget` when the request ends, with its output (a method may keep it:
Suffix Decoding learns from earlier outputs). Both run in the step thread: their work per call stays bounded.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class Drafter(Protocol):
    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]: ...

    def forget(self, request_id: str, output: list[int]) -> None: ...


@runtime_checkable
class DraftsAhead(Protocol):
    """A drafter that can propose past tokens not known yet (`ahead`) without taking them into its state
    (ngram.py); any other is asked with them appended to the known ones."""

    def propose_ahead(self, request_id: str, tokens: list[int], ahead: list[int], limit: int) -> list[int]: ...
