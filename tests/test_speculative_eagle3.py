"""Speculative decoding with an EAGLE-3 head (`{"method": "eagle3", "model": ...}`) end to end on CPU, with
tiny random targets and random heads saved as the published ones are (tests/fixtures/eagle3_heads.py): the
tokens are exactly the engine's without speculation, greedy and seeded; a head that drafts the target's
commonest token gets drafts accepted; aborts and preemption leave every block free; a head that cannot serve
the target fails at construction with a one-line InvalidConfigError naming speculative_config['model']."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.config import EngineConfig, SpeculativeConfig
from asyncllm.errors import InvalidConfigError
from tests.fixtures.eagle3_heads import build_eagle3_head
from tests.fixtures.spec_streams import cancel_and_break

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3, 4, 3, 4, 3, 4, 3]]
GREEDY = SamplingParams(max_tokens=40, temperature=0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, seed=7, top_p=0.95)
ENGINE = dict(num_kv_blocks=96, block_size=4, device="cpu")


@pytest.fixture(scope="module")
def head(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random head for the tiny Qwen3 target over a reduced draft vocabulary (d2t maps it back)."""
    return build_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", tiny_model, draft_vocab_size=40)


def _spec(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _run(model: Path, params: SamplingParams, spec: dict | None, prompts=PROMPTS, **kw) -> tuple[list, dict]:
    llm = LLM(str(model), speculative_config=spec, **{**ENGINE, **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    llm.shutdown()
    return [[s.token_ids for s in o.outputs] for o in outs], stats


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_eagle3_gives_the_same_tokens(
    tiny_model: Path, head: Path, params: SamplingParams, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCLLM_ASYNC_SCHEDULING", str(int(async_scheduling)))
    ref, _ = _run(tiny_model, params, None)
    outs, stats = _run(tiny_model, params, _spec(head))
    assert outs == ref
    assert stats["spec_draft_tokens"] > 0 and stats["spec_num_drafts"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("own_embedding", [False, True], ids=["shared-embedding", "own-embedding"])
def test_a_head_drafting_the_commonest_token_is_accepted(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, own_embedding: bool
) -> None:
    """A Llama target (untied head); the head always drafts the token the target outputs most: those drafts
    are accepted, the acceptance counters move, the tokens stay the plain run's. With its own embedding
    (`embed_tokens.weight`) the head reads that instead of the target's."""
    target = tiny_checkpoints["llama"]
    ref, _ = _run(target, GREEDY, None)
    commonest, count = Counter(t for r in ref for t in r[0]).most_common(1)[0]
    assert count > 3
    head = build_eagle3_head(tmp_path / "head", target, constant_draft=commonest, with_embedding=own_embedding)
    outs, stats = _run(target, GREEDY, _spec(head, k=2))
    assert outs == ref
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["spec_accepted_tokens_pos_0"] > 0


def test_preemption_and_prefix_hits_keep_the_tokens(tiny_model: Path, head: Path) -> None:
    """So few blocks that requests are preempted (the head's KV recomputed with the target's on resumption),
    and a second round hitting the prefix cache: the same tokens, every block back."""
    prompts = [p * 2 for p in PROMPTS] * 2
    ref, ref_stats = _run(tiny_model, GREEDY, None, prompts, num_kv_blocks=40)
    assert ref_stats["num_preemptions"] > 0
    outs, stats = _run(tiny_model, GREEDY, _spec(head), prompts, num_kv_blocks=40, enable_prefix_caching=True)
    assert outs == ref
    assert stats["num_preemptions"] > 0 and stats["spec_draft_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_cancel_and_break_mid_speculation_free_every_block(tiny_model: Path, head: Path) -> None:
    async with AsyncLLMEngine(str(tiny_model), speculative_config=_spec(head), **ENGINE) as engine:
        stats = await cancel_and_break(engine, PROMPTS, timeout=5)
        assert stats["spec_draft_tokens"] > 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (dict(hidden_size=32, intermediate_size=64), r"hidden states of size 32 .* target's are 64"),
        (dict(target_hidden_size=48), r"hidden states of size 48"),
        (dict(vocab_size=500), "vocab_size is 500"),
        (dict(drop=("fc.weight",)), "fc.weight"),
        (dict(drop=("midlayer.self_attn.k_proj.weight",)), "k_proj"),
        (dict(drop=("d2t",), draft_vocab_size=40), "no d2t"),
        (dict(d2t_shift=10_000), "outside the target's vocabulary"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}), r"\[0, 1, 9\] must be three"),
        (dict(eagle_config={}), r"default \(2, L // 2, L - 3\)"),  # a 2-layer target: vLLM's default misses
        (dict(eagle_config={"use_aux_hidden_state": False}), "use_aux_hidden_state"),
        (dict(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 head"),
        (dict(num_hidden_layers=2), "num_hidden_layers=2"),
        (dict(max_position_embeddings=64), r"max_position_embeddings \(64\) is shorter"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(v),
)
def test_a_head_that_cannot_serve_fails_at_construction(
    tiny_model: Path, tmp_path: Path, build: dict, message: str
) -> None:
    head = build_eagle3_head(tmp_path / "head", tiny_model, **build)
    with pytest.raises(InvalidConfigError, match=message) as info:
        LLM(str(tiny_model), speculative_config=_spec(head), **ENGINE)
    assert "\n" not in str(info.value) and "speculative_config['model']" in str(info.value)


def test_a_target_whose_hidden_states_cannot_be_read_fails(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    target = tiny_checkpoints["gemma3"]  # its layers keep their residual stream otherwise
    head = build_eagle3_head(tmp_path / "head", target)
    with pytest.raises(InvalidConfigError, match=r"speculative_config\['model'\]: .*cannot read the hidden states"):
        LLM(str(target), speculative_config=_spec(head), **ENGINE)


def test_the_command_line_flag_takes_an_eagle3_head(tiny_model: Path, head: Path) -> None:
    from asyncllm.server.engine_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    spec = f'{{"method": "eagle3", "model": "{head}", "num_speculative_tokens": 2}}'
    ns = parser.parse_args(["--speculative-config", spec])
    assert EngineConfig.from_kwargs(str(tiny_model), **vars(ns)).scheduler_config.speculative == SpeculativeConfig(
        "eagle3", 2, model=str(head)
    )
    llm = LLM(str(tiny_model), speculative_config=ns.speculative_config, **ENGINE)
    outs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    stats = llm.stats()
    llm.shutdown()
    assert len(outs[0].outputs[0].token_ids) > 0 and stats["spec_draft_tokens"] > 0


def test_the_heads_kv_follows_the_accepted_tokens(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: after a step that accepted drafts, the head's pass over the accepted run left out the step's own
    token (`accepted` holds the tokens after it), so its KV at each of those positions was computed from the
    token two ahead and the last position's from none (drafts then followed the wrong state; the output was
    unchanged, acceptance fell). Every position's last head write before the end must take the token after it."""
    from asyncllm.models.eagle3 import Eagle3Head

    target = tiny_checkpoints["llama"]
    ref, _ = _run(target, GREEDY, None, PROMPTS[:1])
    commonest = Counter(ref[0][0]).most_common(1)[0][0]
    head = build_eagle3_head(tmp_path / "head", target, constant_draft=commonest, with_embedding=True)
    writes: dict[int, int] = {}  # position -> the token of its latest head pass
    forward = Eagle3Head.forward

    def recording(self: Eagle3Head, embeds, hidden, positions, kv_cache, meta):  # type: ignore[no-untyped-def]
        assert self.embed_tokens is not None
        tokens = torch.cdist(embeds.float(), self.embed_tokens.weight.float()).argmin(dim=-1)  # exact rows
        writes.update(zip(positions.tolist(), tokens.tolist()))
        return forward(self, embeds, hidden, positions, kv_cache, meta)

    monkeypatch.setattr(Eagle3Head, "forward", recording)
    outs, stats = _run(target, GREEDY, _spec(head, k=2), PROMPTS[:1])
    assert outs == ref and stats["spec_accepted_tokens"] > 0
    tokens = PROMPTS[0] + outs[0][0]
    wrong = [p for p in range(len(tokens) - 1) if writes.get(p) != tokens[p + 1]]
    assert wrong == []


def test_a_paused_head_proposes_nothing_and_the_tokens_stay(tiny_model: Path, head: Path) -> None:
    """Past `disable_by_batch_size` running requests the head proposes nothing; once the batch shrinks it
    drafts again (from a head KV that misses the paused steps' last positions: drafts less often right, never
    wrong), and the tokens are the plain engine's."""
    lengths = [SamplingParams(max_tokens=m, temperature=0) for m in (40, 10, 10)]
    ref, _ = _run(tiny_model, lengths, None)
    outs, stats = _run(tiny_model, lengths, {**_spec(head), "disable_by_batch_size": 1})
    assert outs == ref
    assert stats["spec_draft_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    paused, paused_stats = _run(tiny_model, GREEDY, {**_spec(head), "disable_by_batch_size": 2})
    assert paused == _run(tiny_model, GREEDY, None)[0]
    assert paused_stats["spec_draft_tokens"] == 0
