"""Speculative decoding end to end on CPU (tiny random Qwen3): the tokens are exactly those of the engine
without it, greedy and seeded, with drafts accepted, rejected and cut by stops; blocks all come back.

A random model rarely copies its prompt, so besides the n-gram drafter the tests use an oracle drafter that
replays the output of a run without speculation (every draft right), optionally corrupting some drafts
(rejections at known places): the verify path is then exercised at every acceptance length.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.core.request import Request
from tests.fixtures.deferred_steps import deferring_steps
from tests.fixtures.spec_drafters import Oracle, drafting_with

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3, 4, 3, 4, 3, 4, 3]]


def _run(model: Path, params: SamplingParams | list[SamplingParams], spec: dict | None, oracle=None, **kw):
    with drafting_with(oracle):
        llm = LLM(str(model), speculative_config=spec, num_kv_blocks=96, block_size=4, **kw)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.stats()
    llm.shutdown()
    return outs, stats


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(max_tokens=40, temperature=0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, seed=7, top_p=0.95)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_ngram_gives_the_same_tokens(tiny_model: Path, params: SamplingParams) -> None:
    ref, _ = _run(tiny_model, params, None)
    outs, stats = _run(tiny_model, params, NGRAM)
    assert _tokens(outs) == _tokens(ref)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    assert stats["spec_draft_tokens"] > 0  # the repeating prompts gave drafts
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
@pytest.mark.parametrize("wrong", [0, 3, 2], ids=["all-right", "every-3rd-wrong", "every-2nd-wrong"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_accepted_and_rejected_drafts(
    tiny_model: Path, params: SamplingParams, wrong: int, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCLLM_ASYNC_SCHEDULING", str(int(async_scheduling)))
    ref, ref_stats = _run(tiny_model, params, None)
    oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}, 4, wrong)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    outs, stats = _run(tiny_model, params, spec, oracle)
    assert _tokens(outs) == _tokens(ref)
    assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in ref]
    drafts, accepted = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    assert drafts > 0 and oracle.num_proposals > 0
    if wrong == 0:
        assert accepted == drafts  # every draft right: each accepted, several tokens a step
        assert stats["num_steps"] < ref_stats["num_steps"] / 2
    else:
        assert 0 < accepted < drafts
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # rejected drafts' blocks came back


@pytest.mark.parametrize(
    "params", [GREEDY, SamplingParams(max_tokens=40, temperature=0.9, seed=7, logprobs=2)], ids=["greedy", "seeded"]
)
def test_chained_steps_stand_or_are_undone_exactly(tiny_model: Path, params: SamplingParams) -> None:
    """Overlapped, a request whose drafts have lately all been accepted has its next step planned while the
    verifying one runs, chained on it (`spec_chained_drafts`); where that step then rejects a draft, the chained
    one is void (`spec_void_drafts`): its draws are given back and its output dropped. The tokens and their
    logprobs stay the plain engine's, greedy and seeded; every block comes back."""
    ref, _ = _run(tiny_model, params, None)
    oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}, 4, wrong=11)
    with deferring_steps() as executors:  # steps run late, as on a GPU: the next is planned meanwhile
        outs, stats = _run(tiny_model, params, {"method": "ngram", "num_speculative_tokens": 4}, oracle)
    assert executors[0].num_late_reads > 0
    assert _tokens(outs) == _tokens(ref)
    if params.logprobs:
        for out, want in zip(outs, ref):
            assert [sorted(e) for e in out.outputs[0].logprobs] == [sorted(e) for e in want.outputs[0].logprobs]
    assert stats["spec_chained_drafts"] > 0 and stats["spec_void_drafts"] > 0
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_speculation_pauses_while_more_requests_run_than_its_limit(
    tiny_model: Path, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `disable_by_batch_size` running requests no request drafts and the steps are exactly those of the
    engine without speculation (overlapped, each request planned while its last step runs); once the batch
    shrinks to the limit, drafts resume. The tokens are the plain engine's throughout."""
    monkeypatch.setenv("ASYNCLLM_ASYNC_SCHEDULING", str(int(async_scheduling)))
    ref, ref_stats = _run(tiny_model, GREEDY, None)
    oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}, 4)
    paused, stats = _run(tiny_model, GREEDY, {**NGRAM, "disable_by_batch_size": 2}, oracle)
    assert _tokens(paused) == _tokens(ref)
    assert stats["spec_draft_tokens"] == oracle.num_proposals == 0  # three ran from the first step to the last
    assert stats["num_steps"] == ref_stats["num_steps"]

    lengths = [SamplingParams(max_tokens=m, temperature=0) for m in (40, 10, 10)]
    ref, ref_stats = _run(tiny_model, lengths, None)
    oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}, 4)
    resumed, stats = _run(tiny_model, lengths, {**NGRAM, "disable_by_batch_size": 1}, oracle)
    assert _tokens(resumed) == _tokens(ref)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0  # the long one, alone, drafted
    assert stats["num_steps"] < ref_stats["num_steps"] - 10
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("wrong", [0, 3])
def test_stops_cut_inside_an_accepted_run(tiny_model: Path, wrong: int) -> None:
    """A stop token, a stop string and max_tokens landing inside an accepted run cut it exactly there."""
    ref, _ = _run(tiny_model, GREEDY, None)
    refs = {tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}
    text = ref[0].outputs[0].text
    cases = [
        SamplingParams(max_tokens=13, temperature=0),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ref[0].outputs[0].token_ids[9]]),
        SamplingParams(max_tokens=40, temperature=0, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
    ]
    for params in cases:
        plain, _ = _run(tiny_model, params, None)
        oracle = Oracle(refs, 4, wrong)
        outs, stats = _run(tiny_model, params, NGRAM, oracle)
        assert oracle.num_proposals > 0  # the oracle's runs were verified, not the config's own drafter's
        for a, b in zip(outs, plain):
            assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason) == (
                b.outputs[0].token_ids,
                b.outputs[0].text,
                b.outputs[0].finish_reason,
            ), params
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_logprobs_are_verified_one_entry_per_output_token(tiny_model: Path) -> None:
    """A request asking for logprobs gets drafts; each accepted token's entry is its own row's, so the entries
    (one per output token) equal a run without speculation's, to float32 rounding (the step's shape differs)."""
    for params in (
        SamplingParams(max_tokens=24, temperature=0, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3, logprobs=0),
    ):
        ref, _ = _run(tiny_model, params, None)
        oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}, 4, wrong=3)
        outs, stats = _run(tiny_model, params, NGRAM, oracle)
        assert _tokens(outs) == _tokens(ref)
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # every request asks for logprobs
        for out, plain in zip(outs, ref):
            got, want = out.outputs[0].logprobs, plain.outputs[0].logprobs
            assert got is not None and want is not None and len(got) == len(want) == len(out.outputs[0].token_ids)
            for a, b in zip(got, want):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


class StopDrafter:
    """Drafts the stop token every time: a request under min_tokens must reject each one it may not draw."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.num_proposals = 0

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        self.num_proposals += 1
        return [self.token] * limit

    def forget(self, request_id: str, output: list[int]) -> None:
        pass


def test_min_tokens_masks_each_verifying_row_at_its_own_count(tiny_model: Path) -> None:
    """Drafts of a stop id are rejected wherever the request has fewer than min_tokens outputs, however far
    ahead in the step the row is; the tokens equal a run without speculation's."""
    ref, _ = _run(tiny_model, GREEDY, None)
    stop = ref[1].outputs[0].token_ids[5]  # a token the model draws early for the second prompt
    params = SamplingParams(max_tokens=30, min_tokens=20, temperature=0, stop_token_ids=[stop])
    plain, _ = _run(tiny_model, params, None)
    drafter = StopDrafter(stop)
    outs, stats = _run(tiny_model, params, NGRAM, drafter)
    assert _tokens(outs) == _tokens(plain)
    assert all(len(t) >= 20 for t in _tokens(outs)) and stats["spec_draft_tokens"] > 0
    assert drafter.num_proposals > 0  # the stop drafts were this drafter's, not the config's own


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.8, frequency_penalty=0.6),
        SamplingParams(max_tokens=30, temperature=0.9, seed=5, repetition_penalty=1.2, frequency_penalty=0.4),
    ],
    ids=["repetition", "presence-frequency", "seeded"],
)
def test_penalties_count_the_drafts_before_each_row_and_forget_the_rejected(
    tiny_model: Path, params: SamplingParams
) -> None:
    """A verifying row's penalties count the drafts before it as output; the draws past an accepted run are
    taken back from the counts at the read. Every request has penalties and drafts, right and wrong: the
    tokens are a run without speculation's."""
    ref, _ = _run(tiny_model, params, None)
    oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}, 4, wrong=3)
    outs, stats = _run(tiny_model, params, NGRAM, oracle)
    assert _tokens(outs) == _tokens(ref)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_prompt_logprobs_are_scored_once_beside_drafts(tiny_model: Path) -> None:
    """Prompt logprobs are scored with the prompt's forward pass; drafts come only with decodes after it, so a
    request asking for both gets the prompt's scores of a run without speculation, and its tokens."""
    params = SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=2)
    ref, _ = _run(tiny_model, params, None)
    oracle = Oracle({tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}, 4, wrong=3)
    outs, stats = _run(tiny_model, params, NGRAM, oracle)
    assert _tokens(outs) == _tokens(ref)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # every request drafted
    for out, plain in zip(outs, ref):
        got, want = out.prompt_logprobs, plain.prompt_logprobs
        assert got is not None and want is not None and len(got) == len(want) == len(out.prompt_token_ids)
        assert got[0] is None and want[0] is None
        for a, b in zip(got[1:], want[1:]):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_prefix_cache_never_serves_rejected_drafts_kv(tiny_model: Path) -> None:
    """Rejected drafts' KV sits in blocks past a request's tokens: none is registered, so a second request
    with the same prompt and output prefix, hitting the cache, still gets the reference tokens."""
    ref, _ = _run(tiny_model, GREEDY, None)
    refs = {tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}
    oracle = Oracle(refs, 4, wrong=2)
    with drafting_with(oracle):
        llm = LLM(str(tiny_model), speculative_config=NGRAM, num_kv_blocks=96, block_size=4)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    follow = [p + t[:20] for p, t in zip(PROMPTS, _tokens(ref))]  # prompt + output prefix: cached blocks
    again = llm.generate(follow, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    # The oracle drafted, and some of its drafts were rejected: their KV sat in the blocks the cache must not serve.
    assert oracle.num_proposals > 0 and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    llm.shutdown()
    assert _tokens(first) == _tokens(ref)
    assert [t[20:] for t in _tokens(ref)] == _tokens(again)


def test_abort_mid_speculation_frees_every_block(tiny_model: Path) -> None:
    ref, _ = _run(tiny_model, GREEDY, None)
    with drafting_with(Oracle({tuple(p): t for p, t in zip(PROMPTS, _tokens(ref))}, 4, wrong=3)):
        llm = LLM(str(tiny_model), speculative_config=NGRAM, num_kv_blocks=96, block_size=4)
    core = llm._engine.core
    for i, prompt in enumerate(PROMPTS):
        core.add_request(Request(f"r{i}", prompt, GREEDY, 0.0, max_tokens=40))
    for _ in range(4):
        core.step()
    assert core.stats().spec_draft_tokens > 0
    for i in range(len(PROMPTS)):
        core.abort(f"r{i}")
    while core.has_unfinished():
        core.step()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    llm.shutdown()


def test_suffix_decoding_drafts_what_earlier_requests_output(tiny_model: Path) -> None:
    """Suffix Decoding: the second time a prompt comes (an agent's repeated call), the first output is in the
    outputs' trie, so most of the second's tokens are drafted and accepted; the tokens are the plain run's."""
    ref, _ = _run(tiny_model, GREEDY, None)
    llm = LLM(str(tiny_model), speculative_config={"method": "suffix", "num_speculative_tokens": 4},
              num_kv_blocks=96, block_size=4, enable_prefix_caching=False)  # fmt: skip
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    before = llm.stats()
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    after = llm.stats()
    llm.shutdown()
    assert _tokens(first) == _tokens(again) == _tokens(ref)
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert accepted >= 0.8 * drafted and accepted >= 0.5 * sum(len(t) for t in _tokens(ref))
    # Accepted drafts by position: one counter per draft position, each at most the one before (a draft is
    # accepted only after every draft before it), summing to the accepted total; vLLM's num_drafts beside them.
    positions = [after[f"spec_accepted_tokens_pos_{i}"] for i in range(4)]
    assert sum(positions) == after["spec_accepted_tokens"] and positions == sorted(positions, reverse=True)
    assert 0 < after["spec_num_drafts"] <= after["spec_draft_tokens"] and "spec_accepted_tokens_pos_4" not in after
    assert after["num_steps"] - before["num_steps"] < before["num_steps"] / 2
    assert after["num_free_blocks"] == after["num_total_blocks"]
