"""Routing without Ray: least outstanding work with ties in turn, prefix affinity from one shared block to
the deepest shared prefix, yielding only to a clear imbalance, and a replica that lost its cache losing its
prefixes."""

from __future__ import annotations

from asyncllm.ray.balancer import BALANCE_ABS, Balancer

BS = 4
BOTH = [True, True]


def _place(b: Balancer, prompt: list[int], ready: list[bool] | None = None) -> int:
    choice = b.choose(prompt, ready or [True] * len(b.load))
    assert choice is not None
    b.load[choice] += 1
    return choice


def test_least_loaded_wins_and_ties_go_round() -> None:
    b = Balancer(3, BS)
    assert [_place(b, [i]) for i in range(6)] == [0, 1, 2, 0, 1, 2]  # shorter than a block: no affinity
    b.load[:] = [5, 1, 3]
    assert b.choose([9], [True, True, True]) == 1
    assert b.choose([9], [True, False, True]) == 2  # never a replica that is not ready
    assert b.choose([9], [False, False, False]) is None


def test_a_shared_first_block_stays_on_one_replica() -> None:
    b = Balancer(2, BS)
    shared = [7, 7, 7, 7]
    homes = {_place(b, [*shared, i, i + 1]) for i in range(BALANCE_ABS)}
    assert len(homes) == 1  # every request sharing the block, whatever follows it
    assert _place(b, [1, 2, 3, 4, 5]) not in homes  # a new prefix goes to the least loaded


def test_the_deepest_shared_prefix_decides() -> None:
    b = Balancer(2, BS)
    system = [5, 5, 5, 5]
    first = _place(b, [*system, 1, 1, 1, 1])
    b.load[first] = BALANCE_ABS + 5  # busy: the next conversation goes to the other replica
    second = _place(b, [*system, 2, 2, 2, 2])
    assert second != first
    b.load[:] = [3, 3]
    # Each conversation's next turn goes where its history is; both replicas hold the shared block now.
    assert b.choose([*system, 1, 1, 1, 1, 9], BOTH) == first
    assert b.choose([*system, 2, 2, 2, 2, 9], BOTH) == second
    b.load[first] = 1
    assert b.choose([*system, 3, 3, 3, 3], BOTH) == first  # only the shared block: the less loaded holder


def test_affinity_yields_to_a_clear_imbalance_only() -> None:
    b = Balancer(2, BS)
    home = _place(b, [1, 1, 1, 1])
    b.load[home] = BALANCE_ABS  # more work, but not by more than BALANCE_ABS
    assert b.choose([1, 1, 1, 1, 2], BOTH) == home
    b.load[home] = BALANCE_ABS + 2  # now out of balance in both senses
    assert b.choose([1, 1, 1, 1, 2], BOTH) == 1 - home
    b = Balancer(2, BS)
    home = _place(b, [1, 1, 1, 1])
    b.load[home] = 2 * BALANCE_ABS + 2
    b.load[1 - home] = BALANCE_ABS + 2  # busy too: within 1.5 times, affinity holds
    assert b.choose([1, 1, 1, 1, 3], BOTH) == home


def test_a_prefix_follows_its_replica_while_it_is_not_ready_and_after_forget() -> None:
    b = Balancer(2, BS)
    home = _place(b, [3, 3, 3, 3])
    ready = [True, True]
    ready[home] = False
    moved = _place(b, [3, 3, 3, 3, 9], ready)
    assert moved == 1 - home
    b.forget(home)  # it died: its cache is gone
    b.load[:] = [0, 0]
    b.load[moved] = 2
    assert b.choose([3, 3, 3, 3], BOTH) == moved  # only the replacement's holder holds it
    b.forget(moved)
    assert b.choose([3, 3, 3, 3], BOTH) == home  # held by nobody: least loaded


def test_remembered_prefixes_are_bounded() -> None:
    b = Balancer(2, BS, max_prefixes=2)
    first = _place(b, [1, 1, 1, 1])
    _place(b, [2, 2, 2, 2])
    _place(b, [3, 3, 3, 3])  # the oldest ([1, 1, 1, 1]) is forgotten
    b.load[:] = [0, 0]
    b.load[first] = 1
    assert b.choose([1, 1, 1, 1], BOTH) == 1 - first
