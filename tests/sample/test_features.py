"""Every declared sampling feature (sample/features.py) through every path: the eager sampler, the plain draw
(`takes_plain_draw`, and `GraphDraw.launch`, what a decode step's draw graph captures), jump-forward
(`may_jump`) and speculative verification (`may_verify`). A path takes a row that asks for a feature only
where the feature says the path applies it or may skip it, and then gives the eager sampler's tokens. Every
`SamplingParams` field is some feature's, or named here as one that never shapes a draw: a new field forces
that decision."""

from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any

import pytest
import torch

from asyncllm.sample.features import FEATURES, Feature, Handling, may_jump, may_verify, takes_plain_draw
from asyncllm.sample.sampler import Sampler, TokenMask
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from asyncllm.worker.graph_draw import GraphDraw
from asyncllm.worker.latest_tokens import LatestTokens
from asyncllm.worker.step_staging import StepStaging

CPU = torch.device("cpu")
VOCAB = 300
WORDS = -(-VOCAB // 32)
EOS = 2
ROWS = 4  # rows per step, each its own request and seed
STEPS = 8
PROMPT = [5, 6, 7, 5]

# Requests asking for each feature (what turns it on), besides a temperature the test sets.
EXAMPLES: dict[str, list[dict[str, Any]]] = {
    "temperature": [dict(temperature=0.7), dict(temperature=1.6)],
    "seed": [dict(seed=1234), dict(seed=-(2**70))],
    "top_k": [dict(top_k=5), dict(top_k=VOCAB + 10)],  # a k beyond the vocabulary keeps every token
    "top_p": [dict(top_p=0.6)],
    "min_p": [dict(min_p=0.3)],
    "penalties": [dict(repetition_penalty=1.5), dict(presence_penalty=2.0), dict(frequency_penalty=1.5)],
    "logit_bias": [dict(logit_bias={5: 8.0, 9: -100.0, 299: 3.5}), dict(logit_bias={"7": 100})],
    "min_tokens": [dict(min_tokens=4), dict(min_tokens=4, stop_token_ids=[7, 9], ignore_eos=True)],
    "logprobs": [dict(logprobs=0), dict(logprobs=3)],
    "prompt_logprobs": [dict(prompt_logprobs=2)],
    "structured_output": [dict(regex="[ab]+"), dict(choice=["x", "y"]), dict(json_object=True)],
}
# SamplingParams fields no feature reads: when a request stops and how many samples it has, never a draw.
NOT_SAMPLING = {"max_tokens", "stop", "include_stop_str_in_output", "n"}
BY_NAME = {f.name: f for f in FEATURES}
CASES = [(BY_NAME[name], kwargs) for name, examples in EXAMPLES.items() for kwargs in examples]


def _params(kwargs: dict[str, Any], greedy: bool) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, **kwargs, **({"temperature": 0.0} if greedy else {})})


def _states(params: SamplingParams, sampler: Sampler, rows: int = ROWS) -> list[SamplingState]:
    """`rows` requests with `params`, each with a seed of its own, registered as the runner does."""
    states = [SamplingState.create(params, 17 * i + 3, PROMPT, frozenset({EOS})) for i in range(rows)]
    for state in states:
        sampler.add(state)
    return states


def _logits(step: int) -> torch.Tensor:
    """Spread logits for the first steps (filters bite), then logits favouring EOS, then the example's stop
    ids (stop masks bite), then one set favouring the prompt's tokens, four times over (penalties bite: a
    token drawn is likely again)."""
    if step < 2:
        return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(step)) * 3
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(min(step, 4))) * 3
    logits[:, [EOS] if step == 2 else [7, 9] if step == 3 else PROMPT] += 10.0
    return logits


def _bitmask(allowed: list[list[int]]) -> torch.Tensor:
    """[len(allowed), WORDS] int32 (xgrammar's layout) allowing each row's tokens."""
    bits = torch.zeros(len(allowed), WORDS * 32, dtype=torch.bool)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = True
    words = (bits.view(len(allowed), WORDS, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _mask(allowed: list[list[int]]) -> TokenMask:
    return TokenMask(_bitmask(allowed), torch.arange(len(allowed)))


def test_every_feature_is_declared_once_with_an_example() -> None:
    names = [f.name for f in FEATURES]
    assert len(set(names)) == len(names)
    assert set(EXAMPLES) == set(names), "a new feature needs examples here"
    for feature, kwargs in CASES:
        assert set(kwargs) <= set(feature.fields) | {"temperature"}, (feature.name, kwargs)


def test_every_sampling_params_field_is_a_features_or_named_as_not_sampling() -> None:
    given = {f.name for f in fields(SamplingParams) if f.init}
    read = [name for feature in FEATURES for name in feature.fields]
    assert len(set(read)) == len(read), "a field belongs to one feature"
    assert not set(read) & NOT_SAMPLING
    assert set(read) | NOT_SAMPLING == given, (
        "declare a new SamplingParams field in sample/features.py, or add it to NOT_SAMPLING if no draw reads it"
    )


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize(("feature", "kwargs"), CASES, ids=lambda c: getattr(c, "name", None) or str(c))
def test_a_request_asks_for_the_feature_and_it_acts_on_its_rows(
    feature: Feature, kwargs: dict[str, Any], greedy: bool
) -> None:
    """`asked` (the request) and `acts` (its fresh state) agree: no feature acts on a row that does not ask
    for it, so the plain draw checks only the features a request asks for."""
    params = _params(kwargs, greedy)
    (state,) = _states(params, Sampler(VOCAB, CPU), rows=1)
    assert feature.asked(params) and feature.acts(state)
    for other in FEATURES:
        assert other.asked(params) == other.acts(state), other.name


def test_a_plain_request_asks_only_for_what_the_plain_draw_applies() -> None:
    plain = SamplingParams()
    (state,) = _states(plain, Sampler(VOCAB, CPU), rows=1)
    always = {f.name for f in FEATURES if f.asked(plain)}
    assert always == {f.name for f in FEATURES if f.acts(state)} == {"temperature", "seed"}
    assert all(BY_NAME[name].plain_draw is Handling.APPLIES for name in always)
    assert takes_plain_draw(state)


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize(("feature", "kwargs"), CASES, ids=lambda c: getattr(c, "name", None) or str(c))
def test_eager_and_plain_draw(feature: Feature, kwargs: dict[str, Any], greedy: bool) -> None:
    """A row asking for the feature takes the plain draw exactly where the feature allows it; then the draw
    graph's function gives the eager sampler's tokens (and the eager sampler no other output), step after
    step. Where the feature keeps a row off the plain draw, the plain draw would indeed have drawn other
    tokens or missed an output on some step: the logits are made for every feature to bite."""
    params = _params(kwargs, greedy)
    eager, plain = Sampler(VOCAB, CPU), Sampler(VOCAB, CPU)
    eager_states, plain_states = _states(params, eager), _states(params, plain)
    allowed = feature.plain_draw.allows(greedy)
    staging, latest = StepStaging(CPU, dynamic_bytes=1024), LatestTokens(CPU, capacity=16)
    graph = GraphDraw(staging, ROWS, latest, plain.draw)
    ids = [f"r{i}" for i in range(ROWS)]
    for r in ids:
        latest.add(r)
    gen = torch.Generator().manual_seed(11)
    mask = None
    if params.structured is not None:  # a few allowed tokens a row: the plain draw would leave them
        mask = _mask([torch.randperm(VOCAB, generator=gen)[:12].tolist() for _ in range(ROWS)])
    bites = False
    for step in range(STEPS):
        logits = _logits(step)
        out = eager(logits, eager_states, mask=mask)
        assert out.token_ids.shape == (ROWS,) and 0 <= int(out.token_ids.min()) <= int(out.token_ids.max()) < VOCAB
        assert (out.logprobs is not None) == (params.logprobs is not None)
        if step == 0:
            assert all(takes_plain_draw(s) is allowed for s in plain_states), (feature.plain_draw, greedy)
        takes = all(map(takes_plain_draw, plain_states))
        assert takes or not allowed
        staging.begin(new_step=True)
        graph.stage(plain.draw_params(plain_states), latest.slots(ids), ROWS)
        staging.flush()
        graph.launch(logits)
        Sampler.drawn(plain_states)  # in step with the eager rows (min_tokens' mask lapses in both)
        same = graph.tokens(ROWS).tolist() == out.token_ids.tolist() and out.logprobs_output is None
        assert same or not takes, step
        bites |= not same
    assert bites or allowed


def test_the_stop_mask_leaves_the_plain_draw_to_its_rows_once_min_tokens_are_drawn() -> None:
    """min_tokens acts per step: its rows take the plain draw once they have drawn enough."""
    (state,) = _states(SamplingParams(temperature=0.8, min_tokens=2), Sampler(VOCAB, CPU), rows=1)
    for _ in range(2):
        assert not takes_plain_draw(state)
        Sampler.drawn([state])
    assert takes_plain_draw(state)


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize(("feature", "kwargs"), CASES, ids=lambda c: getattr(c, "name", None) or str(c))
def test_jump_forward(feature: Feature, kwargs: dict[str, Any], greedy: bool) -> None:
    """A constrained request asking for the feature may jump forward exactly where the feature allows it;
    then a forced token (the one token its mask allows, never a stop id) is the eager sampler's draw."""
    constraint = {} if feature.name == "structured_output" else {"regex": "[ab]+"}
    params = _params({**kwargs, **constraint}, greedy)
    allowed = feature.jump_forward.allows(greedy)
    assert may_jump(params) is allowed, (feature.jump_forward, greedy)
    if not allowed:
        return
    sampler = Sampler(VOCAB, CPU)
    states = _states(params, sampler)
    stops = {EOS, *params.stop_token_set}
    for step in range(3):
        logits = _logits(step)
        # The least likely token that is no stop: filters that ran before the mask would drop it.
        order = logits.argsort(dim=-1).tolist()
        forced = [next(t for t in row if t not in stops) for row in order]
        assert sampler(logits, states, mask=_mask([[t] for t in forced])).token_ids.tolist() == forced


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize(("feature", "kwargs"), CASES, ids=lambda c: getattr(c, "name", None) or str(c))
def test_verification(feature: Feature, kwargs: dict[str, Any], greedy: bool) -> None:
    """A request asking for the feature gets drafts exactly where the feature allows verification (the
    tokens it then gives are tests/test_speculative*.py's and tests/structured/test_speculative.py's)."""
    assert may_verify(_params(kwargs, greedy)) is feature.verify.allows(greedy), (feature.verify, greedy)


@pytest.mark.parametrize("greedy", [False, True])
def test_paths_over_every_pair_of_features(greedy: bool) -> None:
    """Two features together: a path takes the request only where both allow it."""
    for (a, ka), (b, kb) in itertools.combinations(CASES, 2):
        if a is b:
            continue
        params = _params({**ka, **kb}, greedy)
        (state,) = _states(params, Sampler(VOCAB, CPU), rows=1)
        assert takes_plain_draw(state) is (a.plain_draw.allows(greedy) and b.plain_draw.allows(greedy)), (a, b)
        assert may_jump(params) is (a.jump_forward.allows(greedy) and b.jump_forward.allows(greedy)), (a, b)
        assert may_verify(params) is (a.verify.allows(greedy) and b.verify.allows(greedy)), (a, b)


@pytest.mark.parametrize("temperature", [0.0, 1e-7, GREEDY_TEMPERATURE / 2, GREEDY_TEMPERATURE, 0.05, 1.0])
def test_one_definition_of_greedy(temperature: float) -> None:
    """`SamplingParams.greedy` is the one definition: the state, the plain draw's filters and the draw agree."""
    params = SamplingParams(temperature=temperature, top_k=3)
    sampler = Sampler(VOCAB, CPU)
    states = _states(params, sampler)
    assert params.greedy is (temperature < GREEDY_TEMPERATURE)
    assert all(s.greedy is params.greedy for s in states)
    assert takes_plain_draw(states[0]) is params.greedy  # greedy rows skip their top-k
    logits = _logits(0)
    tokens = sampler(logits, states).token_ids
    if params.greedy:
        assert torch.equal(tokens, logits.argmax(dim=-1))
