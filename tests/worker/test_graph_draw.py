"""What of the graphed draw runs without CUDA: which rows take the plain draw (`takes_plain_draw`), the draw's
fixed staged regions (the same device addresses every step, refilled by the step's one flush, padding rows
pointed at the pad slot), and `GraphDraw.launch` (what a draw graph captures) giving the eager sampler's
tokens and recording them as the requests' latest. The graphs themselves: tests/gpu/test_graph_sampling.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm import LLM
from asyncllm.errors import InvalidConfigError
from asyncllm.sample.sampler import Sampler, takes_plain_draw
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.graph_draw import GraphDraw
from asyncllm.worker.latest_tokens import PAD_SLOT, LatestTokens
from asyncllm.worker.step_staging import StepStaging

CPU = torch.device("cpu")
VOCAB = 300
ROWS = 8  # the largest "bucket"


def _state(seed: int = 1, **params: object) -> SamplingState:
    return SamplingState.create(SamplingParams(**params), seed, [1, 2, 3], eos_token_ids=frozenset({2}))


@pytest.mark.parametrize(
    ("params", "plain"),
    [
        (dict(temperature=0.8), True),
        (dict(temperature=0.0), True),
        (dict(temperature=0.0, top_k=5, top_p=0.5), True),  # greedy rows ignore their filters
        (dict(temperature=0.8, top_k=5), False),
        (dict(temperature=0.8, top_p=0.9), False),
        (dict(temperature=0.8, min_p=0.1), False),
        (dict(temperature=0.8, logprobs=2), False),
        (dict(temperature=0.0, logprobs=0), False),
        (dict(temperature=0.8, min_tokens=2), False),  # EOS masked until two tokens are drawn
    ],
)
def test_plain_draw_rule(params: dict, plain: bool) -> None:
    assert takes_plain_draw(_state(**params)) is plain


def test_plain_draw_rule_follows_penalties_stop_masks_and_grammars() -> None:
    sampler = Sampler(VOCAB, CPU)
    penalised = _state(temperature=0.8, repetition_penalty=1.2)
    sampler.add(penalised)
    assert not takes_plain_draw(penalised)
    masked = _state(temperature=0.8, min_tokens=1)
    assert not takes_plain_draw(masked)
    Sampler.drawn([masked])  # one token drawn: min_tokens reached, EOS allowed again
    assert takes_plain_draw(masked)
    assert not takes_plain_draw(_state(temperature=0.8, regex="a+"))  # constrained: a bitmask row in its draw


def _rig(capacity: int = 16) -> tuple[StepStaging, GraphDraw, LatestTokens, Sampler]:
    staging = StepStaging(CPU, dynamic_bytes=1024)
    latest = LatestTokens(CPU, capacity=capacity)
    sampler = Sampler(VOCAB, CPU)
    return staging, GraphDraw(staging, ROWS, latest, sampler.draw), latest, sampler


def test_regions_keep_their_addresses_and_padding_records_into_the_pad_slot() -> None:
    staging, draw, latest, sampler = _rig()
    ids = [f"r{i}" for i in range(5)]
    for r in ids:
        latest.add(r)
    states = [_state(seed=i, temperature=0.5 + i / 10) for i in range(5)]
    addresses = [region.view(ROWS).data_ptr() for region in (draw.temperatures, draw.seeds, draw.offsets, draw.slots)]
    for n in (5, 3, 1):  # steps of shrinking batches in one bucket
        staging.begin(new_step=True)
        draw.stage(sampler.draw_params(states[:n]), latest.slots(ids[:n]), ROWS)
        staging.flush()
        views = (draw.temperatures, draw.seeds, draw.offsets, draw.slots)
        assert [region.view(ROWS).data_ptr() for region in views] == addresses
        assert draw.slots.view(ROWS).tolist() == latest.slots(ids[:n]) + [PAD_SLOT] * (ROWS - n)
        assert draw.temperatures.view(n).tolist() == pytest.approx([s.params.temperature for s in states[:n]])
        assert draw.seeds.view(n).tolist() == [s.seed for s in states[:n]]
        assert draw.offsets.view(n).tolist() == [s.num_sampled for s in states[:n]]
        Sampler.drawn(states[:n])
    staging.begin(new_step=True)
    greedy = [_state(seed=9, temperature=0.0)] * 2
    draw.stage(sampler.draw_params(greedy), latest.slots(ids[:2]), ROWS)  # no parameters: every row greedy
    staging.flush()
    assert draw.temperatures.view(2).tolist() == [0.0, 0.0]
    assert PAD_SLOT not in latest.slots(ids)


def test_launch_draws_the_eager_samplers_tokens_and_records_them() -> None:
    """The function each draw graph captures, run eagerly: the live rows' tokens are `Sampler.__call__`'s from
    the same logits (seeded temperature rows and greedy rows), each recorded in its request's slot; the
    padding rows touch no request's slot."""
    staging, draw, latest, sampler = _rig()
    ids = [f"r{i}" for i in range(6)]
    for r in ids:
        latest.add(r)
    gen = torch.Generator().manual_seed(3)
    for step, n in enumerate((6, 4, 1)):
        states = [_state(seed=10 * i + 1, temperature=0.0 if i % 3 == 0 else 0.7 + i / 10) for i in range(n)]
        for state in states:
            state.num_sampled = step  # a later draw of each request: another offset into its noise
        logits = torch.randn(ROWS, VOCAB, generator=gen)
        staging.begin(new_step=True)
        draw.stage(sampler.draw_params(states), latest.slots(ids[:n]), ROWS)
        staging.flush()
        before = latest.tokens.clone()
        draw.launch(logits)
        expected = sampler(logits[:n], states).token_ids
        assert draw.tokens(n).tolist() == expected.tolist()
        fed = torch.zeros(n, dtype=torch.int64)
        latest.feed(fed, torch.tensor(list(range(n)) + latest.slots(ids[:n])))
        assert fed.tolist() == expected.tolist()
        untouched = [s for s in range(1, before.shape[0]) if s not in latest.slots(ids[:n])]
        assert latest.tokens[untouched].tolist() == before[untouched].tolist()


def test_ready_only_while_the_latest_tokens_keep_their_tensor(caplog: pytest.LogCaptureFixture) -> None:
    _, draw, latest, _ = _rig(capacity=2)
    assert not draw.ready()  # nothing captured yet
    draw.launch(torch.randn(ROWS, VOCAB))
    assert draw.ready()
    for r in ("a", "b"):
        latest.add(r)
    assert draw.ready()
    latest.add("c")  # past the capacity: a new tensor, which captured graphs would not write
    with caplog.at_level("WARNING", logger="asyncllm.worker.graph_draw"):
        assert not draw.ready()
        assert not draw.ready()
    assert [r.message.count("sample eagerly") for r in caplog.records] == [1]  # said once
    assert PAD_SLOT not in latest.slots(["a", "b", "c"])


def test_bad_value_is_refused_naming_the_variable(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_SAMPLING", "yes")
    with pytest.raises(InvalidConfigError, match="ASYNCLLM_CUDA_GRAPH_SAMPLING='yes' is invalid"):
        LLM(str(tiny_model), device="cpu", num_kv_blocks=16)
