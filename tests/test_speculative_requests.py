"""Speculative decoding for requests that share or shape more than their own draws (issue 41): LoRA requests
(each draft runs through the request's adapter) and samples of n > 1 (their drafts write only blocks the
sample owns alone). Each gives exactly the tokens of a run without speculation, greedy and seeded, with drafts
accepted and rejected (`Replay`), and every block comes back, at the end and after an abort.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.core.request import Request
from tests.fixtures.spec_drafters import Replay, drafting_with

ARGS = dict(device="cpu", dtype="float32", num_kv_blocks=128, block_size=4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3, 4, 3, 4, 3, 4, 3]]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=32, temperature=0.9, seed=7, top_p=0.95, ignore_eos=True)


def _run(model: Path, params, spec: dict | None, wrong: int | None = None, ref=None, **kw):
    """`generate` on PROMPTS: (outputs, stats, the drafter). With `wrong` set, a `Replay` of `ref`'s outputs
    drafts."""
    adapters = kw.pop("adapters", {})
    lora = kw.pop("lora", None)
    drafter = None
    if wrong is not None:
        sequences = [(out.prompt_token_ids, o.token_ids) for out in ref for o in out.outputs]
        drafter = Replay(sequences, 4, wrong)
    with drafting_with(drafter):
        llm = LLM(str(model), speculative_config=spec, **{**ARGS, **kw})
    try:
        for name, path in adapters.items():
            llm.add_lora(name, path)
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora=lora)
        return outs, llm.stats(), drafter
    finally:
        llm.shutdown()


def _tokens(outs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_lora_requests_verify_drafts_through_their_adapter(
    tiny_model: Path, tiny_lora_adapters: dict[str, Path], params: SamplingParams
) -> None:
    """Two adapters and the base in one batch, drafted by n-grams and by a replay with rejections: each
    request's 1 + k verifying rows run through its own adapter, so its tokens are a run without speculation's
    (and differ from the base model's: the adapters act)."""
    lora = dict(enable_lora=True, max_lora_rank=8, max_loras=2, lora=["a", "b", None])
    adapters = {name: tiny_lora_adapters[name] for name in ("a", "b")}
    ref, _, _ = _run(tiny_model, params, None, adapters=adapters, **lora)
    base, _, _ = _run(tiny_model, params, None)
    assert _tokens(ref)[:2] != _tokens(base)[:2] and _tokens(ref)[2] == _tokens(base)[2]
    for wrong in (None, 0, 3):
        outs, stats, drafter = _run(tiny_model, params, NGRAM, wrong, ref, adapters=adapters, **lora)
        assert _tokens(outs) == _tokens(ref), wrong
        assert stats["spec_draft_tokens"] > 0, wrong
        assert drafter is None or len(drafter.drafted) == 3, "every request, adapter or not, drafted"
        if wrong == 3:
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_samples_of_n_verify_drafts_in_their_own_blocks(tiny_model: Path, params: SamplingParams) -> None:
    """n = 3 samples of each prompt share its full blocks; each sample drafts (from its siblings' outputs too:
    rejected where they part) and writes drafts' KV only in blocks of its own, so every sample's tokens are a
    run without speculation's, with ample memory and with so little that samples are preempted."""
    n3 = SamplingParams(**{**_fields(params), "n": 3})
    ref, _, _ = _run(tiny_model, n3, None)
    assert all(len({tuple(t) for t in out}) == (1 if params.greedy else 3) for out in _tokens(ref))
    for wrong in (None, 0, 3):
        for blocks in (128, 40):
            outs, stats, drafter = _run(tiny_model, n3, NGRAM, wrong, ref, num_kv_blocks=blocks)
            assert _tokens(outs) == _tokens(ref), (wrong, blocks)
            assert stats["spec_draft_tokens"] > 0
            assert drafter is None or len(drafter.drafted) == 9, "every sample drafted"
            if wrong == 3:
                assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
            assert (stats["num_preemptions"] > 0) == (blocks == 40)
            assert stats["num_free_blocks"] == stats["num_total_blocks"]


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in ("max_tokens", "temperature", "seed", "top_p", "ignore_eos")}


def test_abort_mid_speculation_frees_every_samples_blocks(tiny_model: Path) -> None:
    """Aborting a request of n = 3 while its samples verify drafts (and one of n = 1 beside it) frees every
    block: the prompt's shared blocks once, each sample's own, drafted ones included."""
    n3 = SamplingParams(max_tokens=32, temperature=0.9, seed=7, ignore_eos=True, n=3)
    ref, _, _ = _run(tiny_model, n3, None)
    sequences = [(out.prompt_token_ids, o.token_ids) for out in ref for o in out.outputs]
    with drafting_with(Replay(sequences, 4, wrong=3)):
        llm = LLM(str(tiny_model), speculative_config=NGRAM, **ARGS)
    try:
        core = llm._engine.core
        core.add_request(Request("group", PROMPTS[0], n3, 0.0, max_tokens=32))
        core.add_request(
            Request("single", PROMPTS[1], SamplingParams(max_tokens=32, temperature=0), 0.0, max_tokens=32)
        )
        for _ in range(5):
            core.step()
        assert core.stats().spec_draft_tokens > 0
        assert core.block_manager.num_free_blocks < core.block_manager.num_blocks
        assert len(core.abort("group")) == 3  # one final delta per sample
        core.abort("single")
        while core.has_unfinished():
            core.step()
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    finally:
        llm.shutdown()
