"""`NgramDrafter`: prompt lookup. A request's next tokens are guessed by finding the latest earlier occurrence
of its last n tokens (n from `max_n` down to `min_n`) in its own prompt and output, and copying what followed.

Owns one index per request: n-gram -> where its latest occurrence with a known continuation ends, grown by
the tokens appended since the last proposal (a few dict writes a token), so a proposal never rescans the
sequence. Knows nothing of scheduling or verification; plain Python.
"""

from __future__ import annotations


class _Index:
    __slots__ = ("ends", "upto")

    def __init__(self) -> None:
        # n-gram -> the end (exclusive) of its latest occurrence that some token follows.
        self.ends: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending before this position are indexed


class NgramDrafter:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n or num_tokens < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and num_tokens >= 1, got {min_n}, {max_n}, {num_tokens}")
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._indices: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(`num_tokens`, `limit`) tokens to follow `tokens` (the request's prompt and output, its
        last one included); [] when no n-gram of its tail occurred before, or `limit` < 1."""
        return self.propose_ahead(request_id, tokens, [], limit)

    def propose_ahead(self, request_id: str, tokens: list[int], ahead: list[int], limit: int) -> list[int]:
        """`propose` after `tokens` and then `ahead`, tokens not known yet (drafts being verified: chained
        verification, chain.py): only `tokens` are indexed, so a draft that is rejected never enters the index."""
        index = self._indices.get(request_id)
        if index is None:
            index = self._indices[request_id] = _Index()
        self._extend(index, tokens)
        limit = min(self.num_tokens, limit)
        if limit < 1:
            return []
        seq = tokens + ahead if ahead else tokens
        size = len(seq)
        ends = index.ends
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = ends.get(tuple(seq[size - n :]))
            if end is not None:
                return seq[end : end + limit]
        return []

    def forget(self, request_id: str, output: list[int]) -> None:
        """The request finished: drop its index (unknown ids are a no-op); prompt lookup keeps no outputs."""
        self._indices.pop(request_id, None)

    def _extend(self, index: _Index, tokens: list[int]) -> None:
        """Index the n-grams ending at positions upto..len-1 (exclusive ends): each has a token after it.
        The one ending at len(tokens) is the tail being looked up, indexed next time, once it is followed."""
        ends, lo, hi = index.ends, self.min_n, self.max_n
        for end in range(max(index.upto, lo), len(tokens)):
            for n in range(lo, min(hi, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        index.upto = max(index.upto, len(tokens))
