"""Constrained requests' drafts (speculative decoding): the bitmask rows of a verifying step's drafted
positions, wherever each request's matcher lives.

A sequence with k drafts is drawn at k + 1 logit rows; row j follows its drafts[:j]. Its first row takes the
request's mask as any step's does (`GrammarTable.plan`); row j > 0 takes the mask after drafts[:j]
(`draft_fill.fill_after_drafts`: the matcher accepts the drafts one by one, a row filled after each, then
rolls back, so it stands where it stood). Each home fills its own requests' rows (`MatcherHome.drafts`): the
step thread in place, the grammar process beside it (one message, its rows waited for as its other rows are).
A request in the slow lane (`slow_lane.py`) has its drafted rows filled there from when the step is planned;
if they are not filled when the draw is due, or its own row sits out (`deferral.py`), its drafts are not
verified that step (it may accept none: `MaskPlan.draft_caps`), and nobody waits for them. When the step is
read, the tokens output before its last go to the matchers ahead of the step's usual accept of its last
(`FillJob`): each matcher ends advanced by exactly the accepted tokens. Knows nothing of models or
scheduling.
"""

from __future__ import annotations

from asyncllm.structured_output.host_rows import HostRows
from asyncllm.structured_output.mask_fill import MaskPlan
from asyncllm.structured_output.request_grammar import InlineMatchers, MatcherHome
from asyncllm.structured_output.utf8 import BOUNDARY


def plan_draft_rows(plan: MaskPlan, drafts: list[list[int]]) -> list[int]:
    """Each logit row's bitmask row for a step verifying `drafts` (per sampled sequence, in order): a
    constrained sequence's first row its plan's row, its drafted rows new ones, numbered after the plan's
    (`plan.drafted` records them for `fill_draft_rows`); -1 for an unconstrained sequence's rows. A request in
    the slow lane has its drafted rows filled there from now (`plan.lane_drafts`)."""
    grammar_of = dict(plan.constrained)
    rows: list[int] = []
    for i, (row, own) in enumerate(zip(plan.rows, drafts, strict=True)):
        rows.append(row)
        grammar = grammar_of.get(i)
        if grammar is None or not own:
            rows += [-1] * len(own)
            continue
        drafted = list(range(plan.num_rows, plan.num_rows + len(own)))
        plan.num_rows += len(own)
        plan.drafted.append((i, drafted, grammar, own))
        rows += drafted
        home = grammar.home
        if isinstance(home, InlineMatchers) and home.lane is not None and grammar.slot in home.lane:
            plan.lane_drafts[i] = home.lane.draft(grammar.slot, own)  # after the lane's work on its last token
    return rows


def fill_draft_rows(host: HostRows, plan: MaskPlan) -> None:
    """Write the plan's drafted rows (`plan_draft_rows`) into `host`, each home's from its matchers as they
    stand after the request's last known token: the grammar process's asked for first (it works while the
    step thread fills its own), the slow lane's taken where filled. Where a drafted request's grammar forces
    text after a draft (jump-forward), the step's output ends with the token drawn at that draft's row
    (`plan.draft_caps`: the drafts before it may be accepted): without drafts the forced text would follow that
    token undrawn, as the step's `FillJob` then outputs it."""
    bits, states = host.bits_np, host.states_np
    deferred = set(plan.deferred)
    homes: dict[MatcherHome, list[tuple[int, list[int], int, list[int], bool]]] = {}
    for index, rows, grammar, drafts in plan.drafted:
        bits[rows] = -1  # any token where no matcher fills it: those draws are never output
        states[rows] = BOUNDARY
        if grammar.removed or grammar.error is not None:
            continue
        lane = plan.lane_drafts.pop(index, None)
        home = grammar.home
        if index in deferred or (isinstance(home, InlineMatchers) and home.in_lane(grammar.slot)):
            # In the slow lane (perhaps moved there since the plan): its rows if filled, else no draft verified.
            filled = lane is not None and lane.done() and not lane.cancelled() and lane.exception() is None
            if filled and index not in deferred:
                assert lane is not None
                bits[rows], states[rows] = lane.result()
                continue
            plan.draft_caps[index] = 0
            continue
        homes.setdefault(home, []).append((index, rows, grammar.slot, drafts, grammar.jumps))
    for home in sorted(homes, key=lambda h: not h.beside):
        entries = homes[home]
        rows_of, slots = [e[1] for e in entries], [e[2] for e in entries]
        caps = home.drafts(host, rows_of, slots, [e[3] for e in entries], [e[4] for e in entries])
        plan.draft_caps.update((entries[i][0], cap) for i, cap in caps.items())
