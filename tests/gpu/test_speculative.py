"""Speculative decoding on the GPU (issue 41): every method (ngram, suffix, a draft model, an EAGLE-3 head) gives
exactly the tokens of the engine without it, greedy and seeded, with the CUDA path's defaults (Triton attention,
CUDA graphs, overlapped scheduling) in float32 with IEEE matmuls; structured output's drafted rows too. Drafts
are verified (the counters move) and every block is free at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.fixtures.deferred_steps import deferring_steps
from tests.fixtures.eagle3_heads import build_eagle3_head
from tests.fixtures.spec_drafters import Oracle, drafting_with

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3, 4, 3, 4, 3, 4, 3]]
DRAWS = {
    "greedy": SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, temperature=0.9, seed=7, top_p=0.95, ignore_eos=True),
}
ENGINE: dict = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256)


@pytest.fixture(autouse=True)
def _ieee_matmuls() -> object:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _spec(method: str, model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 4}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    head = build_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", model, draft_vocab_size=40)
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


def _run(model: Path, params: SamplingParams, spec: dict | None) -> tuple[list[list[int]], dict]:
    llm = LLM(str(model), speculative_config=spec, **ENGINE)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draw", list(DRAWS))
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle3"])
def test_every_method_gives_the_tokens_without_speculation(
    tiny_model: Path, method: str, draw: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref, _ = _run(tiny_model, DRAWS[draw], None)
    outs, stats = _run(tiny_model, DRAWS[draw], _spec(method, tiny_model, tmp_path_factory))
    assert outs == ref
    assert stats["spec_num_drafts"] > 0 and stats["spec_draft_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if method == "draft_model" and draw == "greedy":  # the target as its own draft: every greedy draft is right
        assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_draft_tokens"]


@pytest.mark.parametrize("process", ["auto", "on"])
def test_constrained_drafts_give_the_tokens_without_speculation(
    tiny_model: Path, process: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafted rows masked in the step thread or in the grammar process ("on"), each draw queued behind the
    device's waits for its homes' rows (structured_output/draft_rows.py)."""
    pytest.importorskip("xgrammar")  # the device image has none unless .whl carries it (bench/gpu_check.sh)
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", process)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    params = [SamplingParams(max_tokens=40, temperature=t, seed=3, json_schema=schema) for t in (0, 1.0)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = PROMPTS[:2]

    def run(spec: dict | None) -> list[list[int]]:
        llm = LLM(str(tiny_model), speculative_config=spec, **ENGINE)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    assert run(spec) == run(None)


@pytest.mark.parametrize("draw", list(DRAWS))
def test_chained_steps_stand_or_are_undone_on_the_device(tiny_model: Path, draw: str) -> None:
    """Steps chained on a verifying step in flight (core/spec/chain.py) on the device: the chained step's first
    input fed on the device from the last row of the step it follows, in a mixed CUDA graph. The tiny model's
    steps end before the host plans the next, so each reports itself unfinished until read (`deferring_steps`),
    as a larger model's steps are (bench/spec_oracle.py, the 0.6B shape, chains by itself). Drafts replayed
    from the plain run with every 11th wrong, so chains stand and fall."""
    # Long enough for whole runs to be chained on, then missed.
    params = SamplingParams(max_tokens=160, temperature=0.9 if draw == "seeded" else 0, seed=7, ignore_eos=True)
    ref, _ = _run(tiny_model, params, None)
    oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, ref)}, 4, wrong=11)
    with drafting_with(oracle), deferring_steps():
        outs, stats = _run(tiny_model, params, {"method": "ngram", "num_speculative_tokens": 4})
    assert outs == ref
    assert stats["spec_chained_drafts"] > 0 and stats["spec_void_drafts"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
