"""Which constrained rows of a step sit their draw out: those whose request's matcher is in the slow lane
(`slow_lane.py`) and whose next row is not filled yet when the draw is due. Waiting for it would hold every
request of the step behind one request's constraint; instead that row's draw is deferred (the step samples
it under a mask that allows any token, and its token is never output: `ModelRunnerOutput.deferred`), and the
core plans the request again, from its last known token, in a later step. A row whose input is the token of
a deferred draw (planned before the core knew: overlapped scheduling) is deferred too: its logits follow a
token that does not exist. Where every sequence of the step would sit out, the draw waits instead: nobody
else is held. Knows nothing of devices or models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm.structured_output.host_rows import HostRows
from asyncllm.structured_output.request_grammar import InlineMatchers, RequestGrammar
from asyncllm.structured_output.utf8 import BOUNDARY

if TYPE_CHECKING:
    from asyncllm.structured_output.mask_fill import FillJob, MaskPlan


def settle_lane_rows(plan: MaskPlan, host: HostRows, inline: InlineMatchers, source: FillJob | None) -> None:
    """Write the plan's lane rows that are ready into `host`; take the others out of the plan (its extras and
    constrained rows) into `plan.deferred`, their host rows allowing any token. `source`: the job whose
    tokens the lane may still be owed (not accepted yet: its rows' next masks cannot be ready)."""
    lane = inline.lane
    if lane is None or not lane.live:
        return
    sampled = {grammar: i for i, grammar in plan.constrained}
    mine = [
        (row, grammar)
        for row, grammar in plan.extras
        if grammar.home is inline and not grammar.removed and grammar.error is None and grammar.slot in lane
    ]
    if not mine:
        return
    owed = source.index if source is not None and not source.accepted else {}

    def waits(grammar: RequestGrammar) -> bool:
        return grammar in owed or not lane.ready(grammar.slot)

    voided = {grammar for _, grammar in mine if grammar.deferred and plan.follows[sampled[grammar]]}
    waiting = [grammar for _, grammar in mine if grammar in voided or waits(grammar)]
    alone = len(waiting) == plan.num_seqs and not voided and not owed
    out: set[RequestGrammar] = set()
    for row, grammar in mine:
        if grammar in voided or (waits(grammar) and not alone):
            out.add(grammar)
            host.bits_np[row] = -1
            host.states_np[row] = BOUNDARY
        elif (error := inline.take_lane_row(host, row, grammar.slot)) is not None:
            grammar.error = error  # its row allows any token: the request ends with this step, its token unsent
        grammar.deferred = grammar in out
    taken = {grammar for _, grammar in mine}
    plan.extras = [(row, grammar) for row, grammar in plan.extras if grammar not in taken]
    if out:
        plan.deferred = sorted(sampled[grammar] for grammar in out)
        plan.constrained = [(i, grammar) for i, grammar in plan.constrained if grammar not in out]
