"""`AdaptiveDrafter`: the number of drafts a request gets follows what its drafts achieved (issue 41, "Adaptive").

Each verified step reports how many of a request's drafts were accepted; the request's next proposal may carry
at most one more than the average it has been accepting lately (an exponential average, half weight on the
latest step), between 1 and the method's `num_speculative_tokens`. A request whose drafts are always right
climbs back to the full length within a few steps; one whose drafts keep missing proposes a single token, so
a wrong guess costs one logit row, not k. Wraps any `Drafter`; plain Python.
"""

from __future__ import annotations

from asyncllm.core.spec.drafter import Drafter, DraftsAhead

_WEIGHT = 0.5  # of the latest step in the average


class AdaptiveDrafter:
    def __init__(self, inner: Drafter, num_tokens: int) -> None:
        self.inner = inner
        self.num_tokens = num_tokens
        self._accepting: dict[str, float] = {}  # request -> average accepted drafts a verified step
        # The method's way to propose past drafts not verified yet without indexing them (checked once: a
        # protocol's isinstance is slow for a per-step path).
        self._ahead = inner.propose_ahead if isinstance(inner, DraftsAhead) else None

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        return self.inner.propose(request_id, tokens, min(limit, self.cap(request_id)))

    def cap(self, request_id: str) -> int:
        """The most drafts `request_id` may get next: the full length until it has been verified."""
        average = self._accepting.get(request_id)
        if average is None:
            return self.num_tokens
        return max(1, min(self.num_tokens, int(average + 0.5) + 1))

    def propose_after(self, request_id: str, tokens: list[int], ahead: list[int], limit: int) -> list[int]:
        """Drafts to follow `tokens`, then `ahead` (drafts being verified), then the token after them, not known
        yet: the method's proposal one token longer, less its first (the guess of that token; where it guessed
        wrong the drafts after it are rejected)."""
        most = min(limit, self.cap(request_id)) + 1
        if self._ahead is not None:
            return self._ahead(request_id, tokens, ahead, most)[1:]
        return self.inner.propose(request_id, tokens + ahead, most)[1:]

    def expects_all(self, request_id: str, num_drafts: int) -> bool:
        """Whether `request_id` has lately been accepting about `num_drafts` drafts a step (each of its last few
        proposals right through), so a step chained on one of `num_drafts` likely stands."""
        average = self._accepting.get(request_id)
        return average is not None and average >= num_drafts - 0.25

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified step gave `request_id` `num_accepted` of its `num_drafts` drafts."""
        if num_drafts < 1:
            return
        average = self._accepting.get(request_id, float(num_accepted))
        self._accepting[request_id] = (1 - _WEIGHT) * average + _WEIGHT * num_accepted

    def forget(self, request_id: str, output: list[int]) -> None:
        self._accepting.pop(request_id, None)
        self.inner.forget(request_id, output)
