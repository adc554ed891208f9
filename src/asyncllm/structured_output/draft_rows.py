"""Constrained requests' drafts (speculative decoding): the bitmask rows of a verifying step's drafted
positions, and the accepted runs handed back to the matchers.

A sequence with k drafts is drawn at k + 1 logit rows; row j follows its drafts[:j]. Its first row takes the
request's mask as any step's does (`GrammarTable.plan`); row j > 0 takes the mask after drafts[:j]: at `fill`
the matcher accepts the drafts one by one, a row filled after each, then rolls back, so it stands where it
stood. A draft the grammar (or UTF-8) refuses ends that: the rows after it allow any token, as their draws are
never output (the row before drew under a mask refusing that draft, so verification stops there). When the
step is read, the tokens output before its last (the row's own and the accepted drafts) go to the matchers
ahead of the step's usual accept of its last (`FillJob`): the matcher ends advanced by exactly the
accepted tokens. Only the step thread's matchers do this (`GrammarTable.verifies`). Knows nothing of models
or scheduling.
"""

from __future__ import annotations

from asyncllm.structured_output.host_rows import HostRows
from asyncllm.structured_output.mask_fill import MaskPlan
from asyncllm.structured_output.matcher_set import MatcherSet
from asyncllm.structured_output.utf8 import BOUNDARY


def plan_draft_rows(plan: MaskPlan, drafts: list[list[int]]) -> list[int]:
    """Each logit row's bitmask row for a step verifying `drafts` (per sampled sequence, in order): a
    constrained sequence's first row its plan's row, its drafted rows new ones, numbered after the plan's
    (`plan.drafted` records them for `fill`); -1 for an unconstrained sequence's rows."""
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
    return rows


def fill_draft_rows(matchers: MatcherSet, host: HostRows, plan: MaskPlan) -> None:
    """Write the plan's drafted rows (`plan_draft_rows`) into `host`, from the step thread's matchers as they
    stand after the request's last known token. Where a jumping request's grammar forces text after a draft
    (jump-forward), the step's output ends with the token drawn at that draft's row (`plan.draft_caps`: the
    drafts before it may be accepted): without drafts the forced text would follow that token undrawn, as the
    step's `FillJob` then outputs it."""
    bits, states = host.bits_np, host.states_np
    for index, rows, grammar, drafts in plan.drafted:
        bits[rows] = -1  # a row after a refused draft: never output
        states[rows] = BOUNDARY
        if grammar.removed or grammar.error is not None:
            continue
        matchers.resolve([grammar.slot])
        cursor = matchers.cursor(grammar.slot)
        if cursor is None:  # terminated: EOS alone, as its first row (or failed: nothing of it is output)
            bits[rows] = matchers.stop_row
            continue
        matcher, state = cursor
        assert matchers.backend is not None  # a made matcher's
        utf8_next = matchers.backend.utf8.next
        taken = 0
        for row, token in zip(rows, drafts):
            state = int(utf8_next[state, token])
            if state < 0 or not matcher.accept_token(token):
                break
            taken += 1
            states[row] = state
            if matcher.is_terminated():  # a stop token: EOS alone after it, as for a terminated request
                bits[row] = matchers.stop_row
                break
            if grammar.jumps:  # text forced after this draft is output without draws: its row ends the run
                run, _ = matchers.forced_tokens().run(matcher, state)
                taken += len(run)
                if run:
                    plan.draft_caps[index] = taken - len(run) - 1  # the drafts before this one
                    break
            matcher.fill_next_token_bitmask(bits, row)
        if taken:
            matcher.rollback(taken)
