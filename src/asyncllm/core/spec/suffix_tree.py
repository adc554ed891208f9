"""`SuffixTree`: recent requests' outputs as a suffix trie of bounded depth with counts, so a running request
can continue a pattern other requests produced (Suffix Decoding's global tree, arXiv 2411.04975).

Every substring of up to `depth` tokens of the sequences added is a path from the root; a node counts the
occurrences of its path, so a child's count over the sum of its siblings' is how often that token followed.
Sequences are added whole and removed whole (oldest first) once more than `max_sequences` are cached or the
trie holds more than `max_nodes` nodes: a removal replays the insertion with decrements, dropping nodes that
reach zero. Memory is therefore bounded by `max_nodes` (about 200 bytes each), whatever the traffic.

Plain Python; the drafting policy (how long a draft, which tree) is suffix.py's.
"""

from __future__ import annotations

from collections import deque


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTree:
    def __init__(self, depth: int, max_sequences: int, max_nodes: int) -> None:
        if depth < 1 or max_sequences < 0 or max_nodes < 1:
            raise ValueError(f"need depth >= 1, max_sequences >= 0, max_nodes >= 1: {depth}, {max_sequences}")
        self.depth = depth
        self.max_sequences = max_sequences
        self.max_nodes = max_nodes
        self.root = _Node()
        self.num_nodes = 0
        self._sequences: deque[list[int]] = deque()

    def __len__(self) -> int:
        """Sequences cached."""
        return len(self._sequences)

    def add(self, tokens: list[int]) -> None:
        """Cache `tokens` (an output), evicting the oldest sequences past either bound."""
        if self.max_sequences == 0 or not tokens:
            return
        self._walk(tokens, +1)
        self._sequences.append(tokens)
        while self._sequences and (len(self._sequences) > self.max_sequences or self.num_nodes > self.max_nodes):
            self._walk(self._sequences.popleft(), -1)

    def match(self, context: list[int], max_len: int) -> tuple[int, _Node | None]:
        """The longest suffix of `context`, of at most `max_len` tokens, that is a path here and has a token
        after it somewhere: (its length, its node); (0, None) when none. Paths are closed under suffixes, so
        the longest one that exists is found by bisection, then shortened until it has children."""
        lo, hi = 0, min(max_len, self.depth - 1, len(context))
        while lo < hi:  # the longest n with context[-n:] a path
            mid = (lo + hi + 1) // 2
            if self._find(context[len(context) - mid :]) is not None:
                lo = mid
            else:
                hi = mid - 1
        for n in range(lo, 0, -1):
            node = self._find(context[len(context) - n :])
            if node is not None and node.children:
                return n, node
        return 0, None

    @staticmethod
    def continuation(node: _Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent path below `node`, while the product of each step's frequency stays at least
        `min_prob`: (its tokens, their summed probabilities: the expected number accepted)."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < max_tokens and node.children:
            total = sum(child.count for child in node.children.values())
            token, best = max(node.children.items(), key=lambda item: item[1].count)
            prob *= best.count / total
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            node = best
        return tokens, score

    def _find(self, path: list[int]) -> _Node | None:
        node = self.root
        for token in path:
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node

    def _walk(self, tokens: list[int], sign: int) -> None:
        """Count (+1) or uncount (-1) every substring of `tokens` of up to `depth` tokens: the nodes of the
        suffixes ending at each position are the previous position's extended by its token."""
        active: list[_Node] = []  # nodes of the suffixes (1 .. depth - 1 tokens) ending at the previous token
        for token in tokens:
            extended: list[_Node] = []
            for parent in [self.root, *active]:
                child = parent.children.get(token)
                if child is None:
                    if sign < 0:  # unreachable: a removal walks the paths its add made (closed under suffixes)
                        break
                    child = parent.children[token] = _Node()
                    self.num_nodes += 1
                child.count += sign
                if child.count == 0:
                    del parent.children[token]  # its subtree reaches zero in this same walk
                    self.num_nodes -= 1
                if len(extended) < self.depth - 1:
                    extended.append(child)
            active = extended
