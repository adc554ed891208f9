"""Suffix Decoding's pieces against brute force: the automaton's longest earlier match, the outputs' trie counts
(after adds and evictions), and the drafter's choice between a request's own tokens and other outputs."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.core.spec.suffix import SuffixDrafter
from asyncllm.core.spec.suffix_automaton import SuffixAutomaton
from asyncllm.core.spec.suffix_tree import SuffixTree

SEQ = st.lists(st.integers(0, 3), max_size=60)  # a small alphabet: many repeats


def _longest_earlier_match(tokens: list[int]) -> int:
    """The longest n such that tokens[-n:] also ends at some index < len - 1."""
    best = 0
    for n in range(1, len(tokens)):
        tail = tokens[-n:]
        if any(tokens[end - n + 1 : end + 1] == tail for end in range(n - 1, len(tokens) - 1)):
            best = n
    return best


@settings(max_examples=200, deadline=None)
@given(SEQ)
def test_the_automaton_finds_the_longest_earlier_match_after_every_token(tokens: list[int]) -> None:
    sam = SuffixAutomaton()
    for i in range(1, len(tokens) + 1):
        sam.extend(tokens[:i])
        n, end = sam.longest_earlier_match()
        assert n == _longest_earlier_match(tokens[:i])
        if n:
            assert end < i - 1 and tokens[end - n + 1 : end + 1] == tokens[i - n : i]


def _substring_counts(seqs: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for n in range(1, depth + 1):
                if i + n <= len(seq):
                    counts[tuple(seq[i : i + n])] += 1
    return counts


def _trie_counts(tree: SuffixTree) -> Counter[tuple[int, ...]]:
    counts: Counter[tuple[int, ...]] = Counter()
    stack = [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            counts[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return counts


@settings(max_examples=100, deadline=None)
@given(st.lists(SEQ, max_size=6), st.integers(1, 5), st.integers(1, 4))
def test_the_trie_counts_every_substring_of_the_cached_outputs(seqs: list[list[int]], depth: int, keep: int) -> None:
    tree = SuffixTree(depth, max_sequences=keep, max_nodes=10**6)
    for seq in seqs:
        tree.add(seq)
    cached = [s for s in seqs if s][-keep:]  # the oldest leave first; empty outputs are not kept
    want = _substring_counts(cached, depth)
    assert _trie_counts(tree) == want
    assert tree.num_nodes == len(want) and len(tree) == len(cached)


def test_the_trie_keeps_under_its_node_bound() -> None:
    tree = SuffixTree(8, max_sequences=100, max_nodes=50)
    for i in range(20):
        tree.add([i * 10 + j for j in range(6)])  # 6 tokens, 6+5+...+1 = 21 new nodes each
        assert tree.num_nodes <= 50
    assert len(tree) == 2


def test_a_continuation_follows_the_most_frequent_path_while_probable() -> None:
    tree = SuffixTree(6, max_sequences=10, max_nodes=1000)
    for out in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7, 7]):
        tree.add(out)
    n, node = tree.match([5, 1, 2], max_len=4)
    assert n == 2 and node is not None
    tokens, score = SuffixTree.continuation(node, 3, min_prob=0.1)
    assert tokens == [3, 4] and abs(score - (3 / 4 + 2 / 4)) < 1e-9
    assert SuffixTree.continuation(node, 3, min_prob=0.6)[0] == [3]  # 3/4 then 2/4 < 0.6


def test_the_drafter_copies_its_own_tokens_or_other_outputs_whichever_matches_longer() -> None:
    d = SuffixDrafter(4, max_tree_depth=12, max_cached_requests=10, max_spec_factor=1.0, min_token_prob=0.1)
    assert d.propose("a", [1, 2, 3], 4) == []  # nothing seen before
    assert d.propose("a", [1, 2, 3, 4, 1, 2, 3], 4) == [4, 1, 2]  # its own: "1 2 3" matched, 3 tokens at most
    d.forget("a", [4, 1, 2, 3, 50, 51, 52, 53])
    # Another request continues a pattern of a's output: "2 3 50" is 3 long there, its own match is 1 long.
    assert d.propose("b", [9, 2, 8, 2, 3, 50], 4) == [51, 52, 53]
    assert d.propose("b", [9, 2, 8, 2, 3, 50], 1) == [51]  # the room the scheduler gives
    d.forget("b", [])


def test_a_long_prompt_is_indexed_over_several_proposals() -> None:
    d = SuffixDrafter(4, max_tree_depth=12, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.1)
    prompt = [*range(3000), 0, 1]
    proposals = [d.propose("r", prompt, 4) for _ in range(3)]
    assert proposals == [[], [], [2, 3, 4, 5]]  # 1,024 tokens a call, then the match "0 1" copies what followed
