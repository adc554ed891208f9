"""`SuffixDrafter`: Suffix Decoding (arXiv 2411.04975; vLLM's `"method": "suffix"`). A request's next tokens
are guessed from what followed the longest suffix of its tokens elsewhere: earlier in its own prompt and output
(a suffix automaton: any length, O(1) a token), or in recent requests' outputs (a counted suffix trie, the most
frequent continuation while its probability stays at least `min_token_prob`). The longer match wins (the
request's own on a tie: it is the exact text being continued). A draft is at most `max_spec_factor` times the
match's length: short matches guess little, long ones (an agent repeating a tool call, code being rewritten)
guess up to `num_tokens`.

Work per step stays bounded: a request's automaton indexes at most `INDEX_BUDGET` new tokens a proposal (a long
prompt is indexed over its first steps, drafting from the shared outputs meanwhile), and a trie lookup is a
bisection over at most `depth` tokens. Plain Python; knows nothing of scheduling or verification.
"""

from __future__ import annotations

from asyncllm.core.spec.suffix_automaton import SuffixAutomaton
from asyncllm.core.spec.suffix_tree import SuffixTree

INDEX_BUDGET = 1024  # tokens a proposal may index: ~2 ms of the step thread for a new long prompt
MAX_TREE_NODES = 500_000  # the outputs' trie (~100 MB at most); older outputs leave first


class SuffixDrafter:
    def __init__(
        self,
        num_tokens: int,
        max_tree_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> None:
        self.num_tokens = num_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.outputs = SuffixTree(max_tree_depth, max_cached_requests, MAX_TREE_NODES)
        # A match long enough that a draft of num_tokens still fits under the trie's depth.
        self._max_match = max(1, max_tree_depth - num_tokens)
        self._own: dict[str, SuffixAutomaton] = {}

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(`num_tokens`, `limit`) tokens to follow `tokens` (the request's prompt and output, its last
        one included); [] when no suffix of them occurred before, or `limit` < 1."""
        own = self._own.get(request_id)
        if own is None:
            own = self._own[request_id] = SuffixAutomaton()
        own.extend(tokens, INDEX_BUDGET)
        limit = min(self.num_tokens, limit)
        if limit < 1:
            return []
        own_len, own_end = own.longest_earlier_match() if len(own) == len(tokens) else (0, -1)
        shared_len, node = self.outputs.match(tokens, self._max_match)
        if own_len >= shared_len and own_len > 0:
            start = own_end + 1
            return tokens[start : start + self._draft_len(own_len, limit)]
        if node is not None:
            return self.outputs.continuation(node, self._draft_len(shared_len, limit), self.min_token_prob)[0]
        return []

    def forget(self, request_id: str, output: list[int]) -> None:
        """The request finished with `output` (its generated tokens): drop its index, cache the output for
        the requests that follow."""
        self._own.pop(request_id, None)
        self.outputs.add(list(output))

    def _draft_len(self, match_len: int, limit: int) -> int:
        return max(1, min(limit, int(match_len * self.max_spec_factor)))
