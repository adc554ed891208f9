"""Structured output with speculative decoding (issue 41): a constrained request's drafted rows are masked by its
grammar after the drafts before each (structured_output/draft_rows.py), and its matcher ends advanced by exactly
the tokens accepted. JSON schemas, regexes, a choice and an EBNF grammar, greedy and seeded, with jump-forward
on and off, give exactly the tokens of a run without speculation, with drafts right, wrong (a neighbouring
token) and random (mostly refused by the grammar); every output satisfies its constraint.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from asyncllm import LLM, SamplingParams
from tests.fixtures.spec_drafters import Replay, drafting_with
from tests.structured.conftest import ENGINE_ARGS, check, constrained

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3, 4, 3, 4, 3, 4, 3]]
NAMES = ["person", "scores", "regex", "choice", "grammar"]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class RandomDrafts:
    """Proposes random tokens: most are refused by a grammar, the rest by the target's draws."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng, self.vocab = random.Random(seed), vocab
        self.num_proposals = 0

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        self.num_proposals += 1
        return [self.rng.randrange(self.vocab) for _ in range(min(4, limit))]

    def forget(self, request_id: str, output: list[int]) -> None:
        pass


def _params(draw: str) -> list[SamplingParams]:
    """One request per constraint and prompt (seeded draws: a seed each)."""
    return [constrained(name, draw, seed=11 * i + j) for i, name in enumerate(NAMES) for j in range(len(PROMPTS))]


def _generate(model: Path, params: list[SamplingParams], spec: dict | None, drafter: Any = None):
    with drafting_with(drafter):
        llm = LLM(str(model), speculative_config=spec, **ENGINE_ARGS)
    try:
        outs = llm.generate(PROMPTS * len(NAMES), params, use_tqdm=False)
        return outs, llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("jump", [True, False], ids=["jump-forward", "drawn"])
@pytest.mark.parametrize("draw", ["greedy", "t1"], ids=["greedy", "seeded"])
def test_constrained_drafts_give_the_tokens_without_speculation(
    tiny_model: Path, draw: str, jump: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCLLM_JUMP_FORWARD", str(int(jump)))
    params = _params(draw)
    ref, _ = _generate(tiny_model, params, None)
    want = [o.outputs[0].token_ids for o in ref]
    for i, out in enumerate(ref):
        check(NAMES[i // len(PROMPTS)], out.outputs[0].text)
    sequences = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in ref]
    drafters: list[Any] = [None, Replay(sequences, 4, wrong=0), Replay(sequences, 4, wrong=3), RandomDrafts(384, 5)]
    for drafter in drafters:
        outs, stats = _generate(tiny_model, params, SPEC, drafter)
        assert [o.outputs[0].token_ids for o in outs] == want, type(drafter).__name__
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
        assert stats["spec_draft_tokens"] > 0
        if isinstance(drafter, Replay):
            # The JSON-schema and regex requests all drafted (a choice may be forced whole after its first token).
            assert {f"llm-{i}" for i in range(9)} <= drafter.drafted, drafter.drafted
            assert stats["spec_accepted_tokens"] > 0
            if drafter.wrong == 0 and not jump:  # every draft right: each accepted (jumping, a step's output
                assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]  # ends where text is forced)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
