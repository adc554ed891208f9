"""The verify phase's read: the longest run of drafts equal to the target's draws, then the target's own
token; the draw counts of drafted requests given back past the accepted run."""

from __future__ import annotations

from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import ModelRunnerOutput, ReadyStep, ScheduledSeq, SchedulerOutput
from asyncllm.worker.spec_verify import VerifiedRead, plan_verify


def test_accepts_the_longest_matching_prefix_and_the_next_token() -> None:
    states = [SamplingState.create(SamplingParams(), seed, [1]) for seed in range(3)]
    seqs = [
        ScheduledSeq("a", [9, 4, 5, 6], 10, [0], True, num_drafts=3),  # drafts 4 5 6
        ScheduledSeq("b", [7], 3, [1], True),  # a plain decode
        ScheduledSeq("p", [1, 2], 0, [2], False),  # a prompt chunk: no row
        ScheduledSeq("c", [8, 3, 3], 5, [3], True, num_drafts=2),  # drafts 3 3
    ]
    plan = plan_verify(SchedulerOutput(seqs=seqs, num_draft_tokens=5), states)
    assert plan.first == [0, 4, 5] and plan.ahead == [0, 1, 2, 3, 0, 0, 1, 2]
    assert plan.before == [[], [4], [4, 5], [4, 5, 6], [], [], [3], [3, 3]]  # the drafts each row's draw follows
    assert plan.states == [states[0]] * 4 + [states[1]] + [states[2]] * 3
    for state, rows in zip(states, (4, 1, 3)):
        state.num_sampled = 10 + rows  # as the sampler leaves them: every row drawn
    # a: 4 and 5 accepted, 6 rejected (the target drew 8 there); c: the first draft rejected.
    drawn = [4, 5, 8, 2, 77, 1, 3, 3]
    uncounted: list[tuple[SamplingState, int]] = []
    out = VerifiedRead(ReadyStep(ModelRunnerOutput(drawn)), plan, uncounted.extend).result()
    assert out.sampled_token_ids == [4, 77, 1]
    assert out.accepted == {0: [5, 8]}
    assert [s.num_sampled for s in states] == [13, 11, 11]  # 3 tokens, 1, 1: as many draws as without drafts
    assert uncounted == []  # no request here has penalties: nothing to take back


def test_the_draws_past_an_accepted_run_leave_the_penalty_counts() -> None:
    state = SamplingState.create(SamplingParams(repetition_penalty=1.2), 0, [1])
    state.penalty_row = 0  # as the penalty table gives it
    seqs = [ScheduledSeq("a", [9, 4, 5, 6], 10, [0], True, num_drafts=3)]
    plan = plan_verify(SchedulerOutput(seqs=seqs, num_draft_tokens=3), [state])
    uncounted: list[tuple[SamplingState, int]] = []
    out = VerifiedRead(ReadyStep(ModelRunnerOutput([4, 7, 8, 2])), plan, uncounted.extend).result()
    assert out.accepted == {0: [7]}  # 4 accepted, then the target's 7 where 5 was drafted
    assert uncounted == [(state, 8), (state, 2)]  # the two rows after it were drawn, never output


def test_a_cap_ends_the_accepted_run_where_a_grammar_forces_text() -> None:
    """A constrained row's cap (`draft_rows.py`: the grammar forces text after a draft, jump-forward) stops
    acceptance there though later drafts equal the draws: the step's output ends with that draft's row's token,
    and the draws past it are given back as for a rejection."""
    state = SamplingState.create(SamplingParams(), 0, [1])
    seqs = [ScheduledSeq("a", [9, 4, 5, 6], 10, [0], True, num_drafts=3)]
    plan = plan_verify(SchedulerOutput(seqs=seqs, num_draft_tokens=3), [state])
    state.num_sampled = 14
    out = VerifiedRead(ReadyStep(ModelRunnerOutput([4, 5, 6, 2])), plan, list, {0: 1}).result()
    assert out.sampled_token_ids == [4] and out.accepted == {0: [5]}  # 4 accepted, 5 drawn at its row
    assert state.num_sampled == 12  # two tokens output, two draws
