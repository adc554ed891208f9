"""The step delta that crosses the ring: every encoded step decodes to the very `SchedulerOutput` the core
planned, over random runs of new, growing, preempted, resumed, finished and reused requests (drafts and the
speculative flag included); a decode step costs a few bytes per sequence whatever the tables' length; and a
table that shrinks is refused."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.executor.step_codec import AddLoRA, RemoveLoRA, StepCodecError, StepDecoder, StepEncoder, encode_lora
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import PLACEHOLDER, LoRAAdapter, NewRequestData, ScheduledSeq, SchedulerOutput

_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=5, stop=["\n", "END"], seed=3, logprobs=2),
    SamplingParams(repetition_penalty=1.2, stop_token_ids=[7, 9], max_tokens=5, min_tokens=2),
]


@st.composite
def runs(draw: st.DrawFn) -> list[SchedulerOutput]:
    """A run of steps shaped like the scheduler's: each live request's table only grows until it is
    preempted (then restarts) or finished (its id may come back as a new request later)."""
    live: dict[str, list[int]] = {}  # request id -> block table
    known: set[str] = set()  # sent to the workers and not finished
    steps = []
    next_block = 0
    for _ in range(draw(st.integers(1, 12))):
        out = SchedulerOutput()
        for rid in sorted(known):
            if draw(st.integers(0, 5)) == 0:
                out.finished_request_ids.append(rid)
                known.discard(rid)
                live.pop(rid)
        for _ in range(draw(st.integers(0, 3))):
            rid = f"r{draw(st.integers(0, 9))}"  # small id space: ids come back after they finish
            if rid in known:
                continue
            prompt = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20))
            params = draw(st.sampled_from(_PARAMS))
            seed, lora_id = draw(st.integers(-(2**70), 2**70)), draw(st.sampled_from([0, 0, 1, 7]))
            speculative = draw(st.booleans())
            out.new_requests.append(NewRequestData(rid, prompt, params, seed, lora_id, speculative=speculative))
            known.add(rid)
            live[rid] = []
        preempted = {rid for rid in sorted(known) if draw(st.integers(0, 6)) == 0 and live[rid]}
        for rid in sorted(preempted):
            out.preempted_request_ids.append(rid)
            live[rid] = []
        for rid in sorted(known - preempted):
            if not draw(st.booleans()):
                continue
            grow = draw(st.integers(0, 3))
            live[rid] = live[rid] + list(range(next_block, next_block + grow))
            next_block += grow
            tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=6))
            tokens.append(draw(st.sampled_from([PLACEHOLDER, 5])))
            start = draw(st.integers(0, 2**31 - 100))
            sample = draw(st.booleans())
            # Speculative decoding: the last inputs of a sampled sequence may be drafts (up to 16, the config's most).
            num_drafts = draw(st.integers(0, min(len(tokens) - 1, 16))) if sample else 0
            out.num_draft_tokens += num_drafts
            chained = bool(num_drafts) and draw(st.booleans())  # planned on a verifying step in flight
            out.seqs.append(ScheduledSeq(rid, tokens, start, list(live[rid]), sample, num_drafts, chained))
        out.propose_drafts = draw(st.booleans())  # speculation paused or not
        steps.append(out)
    return steps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
@pytest.mark.slow
def test_every_step_round_trips(steps: list[SchedulerOutput]) -> None:
    """decode(encode(step)) equals the step, field by field, for every step of a run, in order."""
    encoder, decoder = StepEncoder(), StepDecoder()
    for step in steps:
        got = decoder.decode(encoder.encode(step))
        assert got.new_requests == step.new_requests
        assert got.finished_request_ids == step.finished_request_ids
        assert got.preempted_request_ids == step.preempted_request_ids
        assert got.seqs == step.seqs
        assert got.num_draft_tokens == step.num_draft_tokens
        assert got.propose_drafts == step.propose_drafts


def _decode_step(n: int, blocks_each: int, pos: int) -> SchedulerOutput:
    return SchedulerOutput(
        seqs=[
            ScheduledSeq(f"q{i}", [PLACEHOLDER], pos, list(range(i * 1000, i * 1000 + blocks_each)), True)
            for i in range(n)
        ]
    )


def test_decode_steps_send_only_new_blocks() -> None:
    """Once the workers hold a table, a decode step carries ~21 bytes per sequence, however long the tables."""
    encoder, decoder = StepEncoder(), StepDecoder()
    new = [NewRequestData(f"q{i}", [1, 2, 3], _PARAMS[0], i) for i in range(256)]
    first = _decode_step(256, 200, 3)
    first.new_requests = new
    decoder.decode(encoder.encode(first))
    step = _decode_step(256, 200, 4)
    message = encoder.encode(step)
    assert len(message) <= 36 + 21 * 256  # the header: magic and 8 uint32
    assert decoder.decode(message).seqs == step.seqs
    grown = _decode_step(256, 201, 5)  # every table gained one block: one more int32 each
    assert len(encoder.encode(grown)) == len(message) + 4 * 256


def test_a_table_that_changes_other_than_by_growing_is_refused() -> None:
    """The workers keep tables by appending: a rewritten block (a core bug) must stop the engine, not corrupt KV."""
    encoder = StepEncoder()
    encoder.encode(
        SchedulerOutput([ScheduledSeq("a", [1], 0, [4, 5], True)], [NewRequestData("a", [1], _PARAMS[0], 0)])
    )
    with pytest.raises(StepCodecError, match="'a'"):
        encoder.encode(SchedulerOutput([ScheduledSeq("a", [1], 1, [4, 6], True)]))
    with pytest.raises(StepCodecError, match="twice"):
        encoder.encode(SchedulerOutput(new_requests=[NewRequestData("a", [1], _PARAMS[0], 0)]))


def test_lora_messages_between_steps() -> None:
    """Adapters added and removed travel in order with the steps, and a step after them still decodes."""
    encoder, decoder = StepEncoder(), StepDecoder()
    add = AddLoRA(LoRAAdapter(3, "sql", "/adapters/sql"))
    assert decoder.decode_message(encode_lora(add)) == add
    assert decoder.decode_message(encode_lora(RemoveLoRA(3))) == RemoveLoRA(3)
    step = SchedulerOutput(
        [ScheduledSeq("r", [1, 2], 0, [4], True)], [NewRequestData("r", [1, 2], SamplingParams(), 5, lora_id=3)]
    )
    assert decoder.decode_message(encoder.encode(step)) == step
