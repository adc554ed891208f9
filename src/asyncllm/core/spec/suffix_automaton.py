"""`SuffixAutomaton`: one request's own tokens, indexed so that the longest suffix of them seen before is found
in O(1) per appended token, whatever its length (prompt lookup without a bound on n).

The automaton of a sequence has at most 2N states and 3N transitions (Blumer et al.), built online: each state
is a class of substrings with the same end positions; `length` is its longest member, `link` its suffix link.
After a token is appended, the state reached through the new last state's suffix link holds the longest suffix
of the sequence that also ends earlier; `first_end` (the end of its first occurrence, fixed when the state is
made) says where the tokens that followed it are. States live in parallel lists (a few hundred bytes per token
of the request: far less than an n-gram index over several n).

Plain Python; knows nothing of drafting policy (suffix.py) or scheduling.
"""

from __future__ import annotations


class SuffixAutomaton:
    __slots__ = ("first_end", "last", "length", "link", "next", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.length: list[int] = [0]
        self.link: list[int] = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.first_end: list[int] = [-1]  # index of the last token of the state's first occurrence
        self.last = 0  # the state of the whole sequence

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int], limit: int | None = None) -> None:
        """Append `tokens[len(self):]`, at most `limit` of them: the sequence only grows (a request's prompt,
        then its output). Reads by index: no copy of a long sequence per call."""
        end = len(tokens) if limit is None else min(len(tokens), len(self.tokens) + limit)
        for i in range(len(self.tokens), end):
            self._append(tokens[i])

    def longest_earlier_match(self) -> tuple[int, int]:
        """(n, end): the longest suffix of the sequence, of n tokens, that also occurred ending at index `end` <
        len - 1 (its first such occurrence); (0, -1) when even the last token is new."""
        state = self.link[self.last]
        if state <= 0:
            return 0, -1
        return self.length[state], self.first_end[state]

    def _append(self, token: int) -> None:
        length, link, nxt, first_end = self.length, self.link, self.next, self.first_end
        position = len(self.tokens)
        self.tokens.append(token)
        cur = len(length)
        length.append(length[self.last] + 1)
        link.append(0)
        nxt.append({})
        first_end.append(position)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: its shorter members also end here now
                clone = len(length)
                length.append(length[p] + 1)
                link.append(link[q])
                nxt.append(dict(nxt[q]))
                first_end.append(first_end[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur
