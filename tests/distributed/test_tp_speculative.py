"""Speculative decoding under tensor parallelism, across real worker processes on CPU (gloo): for every method
(the host's drafters ngram and suffix, and a draft model and an EAGLE-3 head replicated on every rank), greedy
and seeded, TP=2 with drafts gives the tokens of TP=2 and TP=1 without them, and TP=1's tokens and stats with
them, under chunked prefill and preemption; the drafts counters move; constrained requests (structured output)
verify drafts alike on every rank; requests aborted mid-speculation (a cancelled task, a broken loop) give
every block back."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from tests.fixtures.deferred_steps import deferring_steps
from tests.fixtures.eagle3_heads import build_eagle3_head
from tests.fixtures.spec_drafters import Oracle, drafting_with
from tests.fixtures.spec_streams import cancel_and_break
from tests.structured.conftest import check, constrained

pytestmark = pytest.mark.slow  # starts worker processes: seconds each

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3, 4, 3, 4, 3, 4, 3]] * 2
# 24 blocks of 4 tokens for six requests of up to 55 tokens, 16 tokens a step: prompts are chunked and
# requests preempted (resumed ones recompute, their drafter's state and the draft model's KV with them).
ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, seed=7, top_p=0.95, ignore_eos=True)
METHODS = ["ngram", "suffix", "draft_model", "eagle3"]


def _spec(method: str, target: Path, tmp: Path) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 4}
    if method == "draft_model":  # the target as its own draft: greedy drafts are mostly accepted
        return {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    head = tmp / "head"
    if not head.exists():
        build_eagle3_head(head, target, draft_vocab_size=40)
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


def _run(target: Path, params: SamplingParams, spec: dict[str, Any] | None, tp: int) -> tuple[list, dict]:
    llm = LLM(str(target), speculative_config=spec, tensor_parallel_size=tp, **ENGINE)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats()
    finally:
        llm.shutdown()


@cache
def _plain(target: Path, params: SamplingParams, tp: int) -> tuple[list, dict]:
    """The run without speculation (once per model, parameters and size for the whole module)."""
    return _run(target, params, None, tp)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", METHODS)
def test_tp2_with_drafts_gives_the_tokens_without(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, method: str, params: SamplingParams
) -> None:
    spec = _spec(method, tiny_model, tmp_path_factory.getbasetemp())
    plain_tp1, plain_stats = _plain(tiny_model, params, 1)
    plain_tp2, _ = _plain(tiny_model, params, 2)
    assert plain_tp2 == plain_tp1 and plain_stats["num_preemptions"] > 0
    want, want_stats = _run(tiny_model, params, spec, 1)
    got, stats = _run(tiny_model, params, spec, 2)
    assert got == plain_tp2 == want
    assert stats == want_stats  # the same schedule, drafts and acceptances, step for step
    assert stats["spec_draft_tokens"] > 0 and stats["spec_num_drafts"] > 0
    if method == "draft_model" and params.temperature == 0:
        assert stats["spec_accepted_tokens"] > 0.5 * stats["spec_draft_tokens"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("draw", ["greedy", "t1"], ids=["greedy", "seeded"])
def test_tp2_constrained_drafts_give_the_tokens_without(
    tiny_model: Path, draw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON schemas, a regex, a choice and a grammar with n-gram drafts at TP=2: one process's tokens without
    drafts (tensor parallelism never jumps forward: neither does its twin), every output within its constraint."""
    monkeypatch.setenv("ASYNCLLM_JUMP_FORWARD", "0")
    names = ["person", "scores", "regex", "choice", "grammar"]
    prompts = PROMPTS[:3] * len(names)
    params = [constrained(name, draw, seed=11 * i + j) for i, name in enumerate(names) for j in range(3)]

    def run(spec: dict[str, Any] | None, tp: int) -> tuple[list[Any], dict]:
        llm = LLM(str(tiny_model), speculative_config=spec, tensor_parallel_size=tp, **{**ENGINE, "num_kv_blocks": 512})
        try:
            return llm.generate(prompts, params, use_tqdm=False), llm.stats()
        finally:
            llm.shutdown()

    want, _ = run(None, 1)
    got, stats = run(_spec("ngram", tiny_model, Path()), 2)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for i, out in enumerate(got):
        check(names[i // 3], out.outputs[0].text)
    assert stats["spec_accepted_tokens"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
async def test_aborts_mid_speculation_free_every_block(tiny_model: Path, tmp_path: Path, method: str) -> None:
    spec = _spec(method, tiny_model, tmp_path)
    args = {**ENGINE, "num_kv_blocks": 96}
    async with AsyncLLMEngine(str(tiny_model), speculative_config=spec, tensor_parallel_size=2, **args) as engine:
        stats = await cancel_and_break(engine, PROMPTS, timeout=10)
        assert stats["spec_draft_tokens"] > 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        # The engine goes on after the aborts: a fresh request under speculation still runs to its end.
        tokens: list[int] = []
        async for chunk in engine.stream(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)):
            tokens += chunk.token_ids
        assert len(tokens) == 20 and chunk.finish_reason == "length"


def test_tp2_chained_steps_stand_or_are_undone_on_every_rank(tiny_model: Path) -> None:
    """Steps chained on a verifying step in flight (core/spec/chain.py), read late as on a GPU: every rank stages
    the chained step before reading the one it follows, as rank 0 does, and finds the same ones void; seeded
    tokens are the plain run's."""
    plain, _ = _plain(tiny_model, SEEDED, 1)
    oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, plain)}, 4, wrong=11)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with drafting_with(oracle), deferring_steps():
        got, stats = _run(tiny_model, SEEDED, spec, 2)
    assert got == plain
    assert stats["spec_chained_drafts"] > 0 and stats["spec_void_drafts"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
