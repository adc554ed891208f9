"""`DraftProposals`: the core's side of the "draft_model" method. The runner drafts with the draft model after
each step of a speculative request (worker/draft_model.py) and hands the proposals up with the step's output
(`ModelRunnerOutput.drafts`); they are kept here per request and handed to the scheduler at the request's next
decode, only if they still follow its tokens (no token was appended since: a forced run, a resumed request).

`reserve_lookahead`: the draft model writes its own KV at the positions it drafts, past the request's tokens,
into the request's blocks (the same block ids as the target's; its own cache tensors). The scheduler gives a
sampling step's request blocks that far ahead when memory allows; the runner drafts only as far as the blocks
reach, so no draft write ever lands in a block of another request. Plain Python.
"""

from __future__ import annotations

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import Request


class DraftProposals:
    def __init__(self) -> None:
        self._offers: dict[str, tuple[int, int, list[int]]] = {}  # request -> (its length, its last token, drafts)

    def offer(self, request_id: str, tokens: list[int], drafts: list[int]) -> None:
        """The draft model's `drafts` to follow `tokens` (the request's prompt and output once the step that
        drafted them was appended)."""
        self._offers[request_id] = (len(tokens), tokens[-1], drafts)

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """The drafts offered for exactly `tokens`, at most `limit`; [] when none were, or they follow other
        tokens. Each offer is handed out once (the step that verifies it drafts the next)."""
        offer = self._offers.pop(request_id, None)
        if offer is None or limit < 1:
            return []
        length, last, drafts = offer
        if length != len(tokens) or tokens[-1] != last:
            return []
        return drafts[:limit]

    def forget(self, request_id: str, output: list[int]) -> None:
        self._offers.pop(request_id, None)


def reserve_lookahead(bm: BlockManager, request: Request, upto: int, lookahead: int, keep_free: int) -> None:
    """Blocks for `lookahead` positions after the first `upto` of `request` (never past its prompt plus
    max_tokens), while at least `keep_free` blocks stay free (the running requests' next tokens come first:
    a lookahead never makes the scheduler preempt), beyond those promised to requests whose prefixes the step
    restores (`BlockManager.stage`: they take their blocks in the next step). Called while the step is planned,
    before its computed count moves; changes nothing when memory is short (the runner then drafts fewer tokens)."""
    end = min(upto + lookahead, request.num_prompt_tokens + request.max_tokens)
    needed = bm.blocks_needed(end) - len(request.block_ids)
    if needed > 0 and bm.num_unpromised_blocks - needed >= keep_free:
        bm.allocate(request, end - request.num_computed_tokens)
