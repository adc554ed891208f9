"""Speculative decoding with a draft model (`{"method": "draft_model", "model": ...}`) end to end on CPU, tiny
random checkpoints with the same tokenizer: the tokens are exactly the engine's without speculation, greedy and
seeded, whether the draft is the target itself (every greedy draft right) or another model (most drafts wrong);
aborts, preemption and the prefix cache leave every block free; a draft that cannot serve the target fails at
construction with a one-line InvalidConfigError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.errors import InvalidConfigError
from tests.fixtures.spec_streams import cancel_and_break
from tests.fixtures.tiny_models import build_checkpoint, linked_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3, 4, 3, 4, 3, 4, 3]]
GREEDY = SamplingParams(max_tokens=40, temperature=0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, seed=7, top_p=0.95)
ENGINE = dict(num_kv_blocks=96, block_size=4, device="cpu")


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model with the target's tokenizer: one layer, other weights (its drafts mostly miss)."""
    return build_checkpoint(tmp_path_factory.mktemp("draft") / "qwen3_1layer", "qwen3", seed=1, num_hidden_layers=1)


def _spec(draft: Path, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def _run(model: Path, params: SamplingParams, spec: dict | None, prompts=PROMPTS, **kw) -> tuple[list, dict]:
    llm = LLM(str(model), speculative_config=spec, **{**ENGINE, **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    llm.shutdown()
    return [[s.token_ids for s in o.outputs] for o in outs], stats


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_self_draft_gives_the_same_tokens_and_is_accepted(
    tiny_model: Path, params: SamplingParams, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target as its own draft: greedy drafts are the target's greedy tokens (acceptance near 1; rows of
    another shape may round differently); seeded output is the plain run's whatever the drafts."""
    monkeypatch.setenv("ASYNCLLM_ASYNC_SCHEDULING", str(int(async_scheduling)))
    ref, _ = _run(tiny_model, params, None)
    outs, stats = _run(tiny_model, params, _spec(tiny_model))
    assert outs == ref
    assert stats["spec_draft_tokens"] > 0 and stats["spec_num_drafts"] > 0
    if params.temperature == 0:
        assert stats["spec_accepted_tokens"] > 0.9 * stats["spec_draft_tokens"]
        assert stats["num_steps"] < 0.5 * sum(len(o[0]) for o in ref)  # most steps output several tokens
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_another_draft_model_gives_the_same_tokens(tiny_model: Path, other_draft: Path, params: SamplingParams) -> None:
    ref, _ = _run(tiny_model, params, None)
    outs, stats = _run(tiny_model, params, _spec(other_draft, k=3))
    assert outs == ref
    assert stats["spec_draft_tokens"] > 0
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # its drafts miss: rejections were verified
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_n_samples_each_draft_their_own(tiny_model: Path) -> None:
    """n > 1: each sample drafts from its own last token into blocks it owns alone; seeded samples stay."""
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=3)
    greedy_n = SamplingParams(max_tokens=24, temperature=0, n=2)
    for p in (params, greedy_n):
        ref, _ = _run(tiny_model, p, None)
        outs, stats = _run(tiny_model, p, _spec(tiny_model))
        assert outs == ref
        assert stats["spec_draft_tokens"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_preemption_recomputes_the_drafts_kv_too(tiny_model: Path, other_draft: Path) -> None:
    """So few blocks that requests are preempted (their KV, the draft's too, recomputed on resumption) and
    lookahead blocks are scarce: the same tokens, every block back."""
    prompts = [p * 2 for p in PROMPTS] * 2
    ref, ref_stats = _run(tiny_model, GREEDY, None, prompts, num_kv_blocks=40)
    assert ref_stats["num_preemptions"] > 0
    for draft in (tiny_model, other_draft):
        outs, stats = _run(tiny_model, GREEDY, _spec(draft), prompts, num_kv_blocks=40)
        assert outs == ref
        assert stats["num_preemptions"] > 0 and stats["spec_draft_tokens"] > 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_prefix_cache_hits_carry_the_drafts_kv(tiny_model: Path) -> None:
    """A prefix cached by one request serves the next one's draft too (the draft computed it with the
    target): the self-draft's drafts after a cache hit are still accepted, and the tokens are the plain run's."""
    ref, _ = _run(tiny_model, GREEDY, None)
    follow = [p + t[0][:20] for p, t in zip(PROMPTS, ref)]  # prompt + output prefix: cached blocks
    llm = LLM(str(tiny_model), speculative_config=_spec(tiny_model), enable_prefix_caching=True, **ENGINE)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    before = llm.stats()
    again = llm.generate(follow, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    after = llm.stats()
    llm.shutdown()
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    assert [o.outputs[0].token_ids for o in first] == [t[0] for t in ref]
    assert [o.outputs[0].token_ids for o in again] == [t[0][20:] for t in ref]
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 0 and accepted > 0.9 * drafted


async def test_cancel_and_break_mid_speculation_free_every_block(tiny_model: Path) -> None:
    async with AsyncLLMEngine(str(tiny_model), speculative_config=_spec(tiny_model), **ENGINE) as engine:
        stats = await cancel_and_break(engine, PROMPTS, timeout=5)
        assert stats["spec_draft_tokens"] > 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def _edited(src: Path, dst: Path, **changes: object) -> Path:
    """A copy of checkpoint `src` whose config.json has `changes` (the checks run before any weight is read)."""
    config = json.loads((src / "config.json").read_text())
    return linked_checkpoint(src, dst, config__json=json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(vocab_size=500), "vocabulary has 500 entries"),
        (dict(max_position_embeddings=64), r"max_position_embeddings \(64\) is shorter than .* max_model_len"),
        (dict(architectures=["NoSuchForCausalLM"]), "cannot be the draft"),
        (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "cannot be the draft: checkpoint weight"),
    ],
    ids=["vocabulary", "positions", "not-a-model", "weights-of-another-family"],
)
def test_a_draft_that_cannot_serve_fails_at_construction(
    tiny_model: Path, tmp_path: Path, changes: dict, message: str
) -> None:
    draft = _edited(tiny_model, tmp_path / "draft", **changes)
    with pytest.raises(InvalidConfigError, match=message) as info:
        LLM(str(tiny_model), speculative_config=_spec(draft), **ENGINE)
    assert "\n" not in str(info.value) and "speculative_config['model']" in str(info.value)


def test_a_sliding_window_draft_fails_at_construction(tiny_model: Path, tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(InvalidConfigError, match=r"speculative_config\['model'\]: .*sliding_window=8"):
        LLM(str(tiny_model), speculative_config=_spec(tiny_checkpoints["mistral_swa"]), **ENGINE)


def test_a_paused_draft_proposes_nothing_and_resumes_exactly(tiny_model: Path) -> None:
    """Past `disable_by_batch_size` running requests the draft model proposes nothing (the steps are the plain
    engine's); it keeps following every token, so once the batch shrinks its drafts (the target itself: right)
    are accepted again and the tokens stay the plain engine's."""
    lengths = [SamplingParams(max_tokens=m, temperature=0) for m in (40, 10, 10)]
    ref, _ = _run(tiny_model, lengths, None)
    outs, stats = _run(tiny_model, lengths, {**_spec(tiny_model), "disable_by_batch_size": 1})
    assert outs == ref
    assert stats["spec_accepted_tokens"] > 0.9 * stats["spec_draft_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    paused, paused_stats = _run(tiny_model, GREEDY, {**_spec(tiny_model), "disable_by_batch_size": 2})
    assert paused == _run(tiny_model, GREEDY, None)[0]
    assert paused_stats["spec_draft_tokens"] == 0


def test_a_draft_whose_tokenizer_differs_fails_at_construction(tiny_model: Path, tmp_path: Path) -> None:
    """Same vocabulary size, two tokens' ids swapped: the draft would propose ids that mean other strings. The
    check reads the target's tokenizer, which the engine loads in the background (it must wait for it, not
    skip the check while it is still loading)."""
    spec = json.loads((tiny_model / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    draft = linked_checkpoint(tiny_model, tmp_path / "draft", tokenizer__json=json.dumps(spec))
    with pytest.raises(InvalidConfigError, match=r"the draft's tokenizer differs from the target's \(token ") as info:
        LLM(str(tiny_model), speculative_config=_spec(draft), **ENGINE)
    assert "\n" not in str(info.value)
