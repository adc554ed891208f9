"""`PromptScorer` (which rows of a step score which prompt tokens) and `score_prompts` (the LM head in slices)
against their definitions: position p scores prompt token p + 1, each position once."""

from __future__ import annotations

import pytest
import torch

from asyncllm.sample.prompt_logprobs import PromptScorer, score_prompts
from asyncllm.step import ScheduledSeq, SchedulerOutput

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def _step(*seqs: tuple[str, list[int], int]) -> SchedulerOutput:
    return SchedulerOutput(seqs=[ScheduledSeq(rid, ids, start, [0, 1, 2], False) for rid, ids, start in seqs])


def test_chunks_score_the_next_token_across_their_boundaries() -> None:
    scorer = PromptScorer()
    scorer.add("a", PROMPT, 2)
    assert scorer
    # "x" (3 rows) comes first in the step: "a"'s rows start at 3
    plan = scorer.plan(_step(("x", [1, 2, 3], 0), ("a", PROMPT[:4], 0)))
    assert plan is not None
    assert (plan.request_ids, plan.counts, plan.num_alternatives) == (["a"], [4], [2])
    assert plan.rows == [3, 4, 5, 6] and plan.targets == PROMPT[1:5]  # the chunk's last row scores token 4
    plan = scorer.plan(_step(("a", PROMPT[4:8], 4)))
    assert plan is not None and plan.rows == [0, 1, 2, 3] and plan.targets == PROMPT[5:9]
    # The last chunk: its last position draws the first token and scores nothing; the prompt is done
    plan = scorer.plan(_step(("a", PROMPT[8:], 8)))
    assert plan is not None and plan.rows == [0] and plan.targets == [PROMPT[9]]
    assert not scorer
    assert scorer.plan(_step(("a", [7], 10))) is None


def test_a_recomputed_prompt_is_scored_once() -> None:
    """Preempted after its first chunk, the request recomputes from position 0: only new positions score."""
    scorer = PromptScorer()
    scorer.add("a", PROMPT, 0)
    scorer.plan(_step(("a", PROMPT[:4], 0)))
    assert scorer.plan(_step(("a", PROMPT[:3], 0))) is None  # all of it scored before
    plan = scorer.plan(_step(("a", PROMPT[:6], 0)))
    assert plan is not None and plan.rows == [4, 5] and plan.targets == PROMPT[5:7]


def test_a_skipped_position_is_a_broken_invariant() -> None:
    """A request scoring its prompt must never start past what it scored (a prefix hit would skip positions)."""
    scorer = PromptScorer()
    scorer.add("a", PROMPT, 1)
    with pytest.raises(AssertionError, match="every position"):
        scorer.plan(_step(("a", PROMPT[4:8], 4)))


def test_nothing_to_score() -> None:
    scorer = PromptScorer()
    scorer.add("one", [5], 3)  # one token: its only entry is None
    assert not scorer
    scorer.add("a", PROMPT, 1)
    scorer.remove("a")
    assert not scorer and scorer.plan(_step(("a", PROMPT, 0))) is None


def test_slices_equal_one_pass() -> None:
    torch.manual_seed(0)
    vocab, width = 50, 8
    head = torch.randn(vocab, width)
    hidden = torch.randn(12, width)
    scorer = PromptScorer()
    scorer.add("a", PROMPT, 3)
    scorer.add("b", PROMPT[:6], 0)
    plan = scorer.plan(_step(("a", PROMPT[:7], 0), ("b", PROMPT[:5], 0)))
    assert plan is not None and plan.counts == [7, 5]
    calls: list[int] = []

    def compute_logits(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows @ head.T

    out = score_prompts(plan, hidden, compute_logits, max_rows=5, pad_rows=lambda r: 8 if r > 4 else 4)
    assert calls == [8, 8, 4]  # 12 rows in slices of 5, 5, 2, each padded
    got = out.to_host().to_dicts()
    want = (hidden @ head.T).log_softmax(-1)
    for request_id, start, k in (("a", 0, 3), ("b", 7, 0)):
        entries = got[request_id]
        for i, entry in enumerate(entries):
            row, target = start + i, PROMPT[i + 1]
            top = want[row].topk(k).indices.tolist() if k else []
            assert set(entry) == {target, *top}
            for token, value in entry.items():
                assert abs(value - want[row, token].item()) < 1e-6
