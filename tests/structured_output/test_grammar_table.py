"""The grammar process against the step thread's matchers, at the runner's `GrammarTable`: the same
requests, steps and tokens give bit-identical masks and the same failures, whether every matcher stays in
the step thread or a lazily started process takes the requests admitted once it is ready (so steps mix
both homes while it starts), its threads each taking a share of a step's rows; and a table whose requests
are all unconstrained never starts it. On CUDA, draws that wait on the device for the process's rows see the
same masks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from asyncllm import SamplingParams
from asyncllm.sample.state import SamplingState
from asyncllm.step import ModelRunnerOutput, ReadyStep
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.grammar_table import GrammarProcessMode, GrammarTable
from tests.structured.conftest import CONSTRAINTS

VOCAB = 384
ROWS = 40  # live requests a step: the grammar process splits them over its threads (16 rows or more each)
SPECS: list[dict[str, Any]] = [field for field, _ in CONSTRAINTS.values()] + [
    {"grammar": r"root ::= [\ud800-\udfff]"},  # no valid UTF-8 spells it: refused after its lead byte
]


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> GrammarBackend:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return GrammarBackend(tokenizer, VOCAB, [tokenizer.eos_token_id])


def _pick(row: np.ndarray, rng: random.Random) -> int:
    """A token the row allows, uniformly; token 0 where it allows none (as the draw does)."""
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB])
    return int(allowed[rng.randrange(len(allowed))]) if len(allowed) else 0


def _run(table: GrammarTable, backend: GrammarBackend, steps: int, seed: int) -> list[Any]:
    """Drive `table` through `steps` overlapped steps in the engine's order: each step planned and its mask
    asked for (`fill`) before the previous step's tokens are read, its own tokens drawn (on the host, here)
    after that. `ROWS` requests at a time, each ending at EOS, a refusal or 24 tokens and replaced by the next;
    the first `ROWS` admitted at once, the rest after the process (if any) is ready. Every step's masks (in
    sampled order) and tokens, then ("failed", request, error) for each request that failed, wherever its
    failure was reported (with the mask, or with the tokens: a table whose draws wait on the device learns of
    some late)."""
    rng = random.Random(seed)
    made = 0
    number: dict[int, int] = {}

    def admit() -> SamplingState:
        nonlocal made
        spec = SPECS[made % len(SPECS)]
        state = SamplingState.create(SamplingParams(**spec, temperature=1.0, max_tokens=24), made, [1])
        table.add(str(made), state)
        number[id(state)] = made
        made += 1
        return state

    live = [admit() for _ in range(ROWS)]
    table.wait_for_process()  # lazily started by the first add: the next requests' matchers go there
    lengths = {id(s): 0 for s in live}
    seen: list[Any] = []
    failures: set[tuple[int, str]] = set()
    pending: tuple[Any, list[SamplingState]] | None = None
    ended: list[SamplingState] = []
    for _ in range(steps):
        for state in ended:  # gone at the next submit, as the core's finished requests are
            live.remove(state)
            table.remove(str(number[id(state)]))
        ended = []
        while len(live) < ROWS:
            live.append(admit())
            lengths[id(live[-1])] = 0
        plan = table.plan([str(number[id(state)]) for state in live])
        states = list(live)
        mask, failed = table.fill(plan, torch.tensor(plan.rows, device=table.device))
        failures.update((number[id(states[i])], str(e)) for i, e in (failed or {}).items())
        if pending is not None:
            job, read = pending
            output = table.advance(job)  # the core reads the step: the matchers take its tokens
            late = output.failed or {}
            failures.update((number[id(read[i])], str(e)) for i, e in late.items())
            for i, (state, token) in enumerate(zip(read, output.sampled_token_ids)):
                if state in ended or state not in live:
                    continue
                lengths[id(state)] += 1
                if i in late or token in backend.stop_token_ids or lengths[id(state)] >= 24:
                    ended.append(state)
        rows = mask.bitmask[mask.mask_rows].cpu().numpy()  # on CUDA: once the device has the rows
        tokens = [_pick(row, rng) for row in rows]
        seen.append((rows.tobytes(), tokens))
        step = ReadyStep(ModelRunnerOutput(sampled_token_ids=tokens, failed=failed))
        pending = (table.follow(plan, step), states)
    return seen + sorted(("failed", *f) for f in failures)


@pytest.mark.slow
def test_process_gives_the_step_threads_masks_and_failures(backend: GrammarBackend) -> None:
    inline = GrammarTable(backend, ROWS, VOCAB, torch.device("cpu"), GrammarProcessMode.OFF)
    mixed = GrammarTable(backend, ROWS, VOCAB, torch.device("cpu"), GrammarProcessMode.LAZY, process_threads=3)
    try:
        want = _run(inline, backend, 60, seed=3)
        got = _run(mixed, backend, 60, seed=3)
        process = mixed.process
        assert process is not None and process.ready and process.live > 0, "the process serves the later requests"
        assert got == want
        assert any("no token of the model's vocabulary" in entry[2] for entry in want if entry[0] == "failed")
    finally:
        inline.close()
        mixed.close()
    assert mixed.process is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draws_that_wait_on_the_device_for_the_process_rows_see_the_same_masks(backend: GrammarBackend) -> None:
    """On CUDA, with every request's matcher in the grammar process, each step's draw is queued at once
    behind a device-side wait for its rows' flag: the masks, tokens and failures are the step thread's."""
    cuda = torch.device("cuda")
    inline = GrammarTable(backend, ROWS, VOCAB, cuda, GrammarProcessMode.OFF)
    awaited = GrammarTable(backend, ROWS, VOCAB, cuda, GrammarProcessMode.EAGER, process_threads=3, awaited_masks=True)
    try:
        assert awaited.wait_for_process()
        want = _run(inline, backend, 60, seed=5)
        got = _run(awaited, backend, 60, seed=5)
        assert awaited.waits_on_device and not inline.waits_on_device
        assert got == want
    finally:
        inline.close()
        awaited.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draws_that_wait_on_the_device_for_both_homes_rows_see_the_same_masks(backend: GrammarBackend) -> None:
    """A lazily started process: the first requests keep their matchers in the step thread (steps whose rows
    are all there, then steps mixing both homes), each draw waiting on the device for every home's flag."""
    cuda = torch.device("cuda")
    inline = GrammarTable(backend, ROWS, VOCAB, cuda, GrammarProcessMode.OFF)
    mixed = GrammarTable(backend, ROWS, VOCAB, cuda, GrammarProcessMode.LAZY, process_threads=3, awaited_masks=True)
    try:
        want = _run(inline, backend, 60, seed=7)
        got = _run(mixed, backend, 60, seed=7)
        process = mixed.process
        assert process is not None and process.live > 0 and mixed.waits_on_device
        assert got == want
    finally:
        inline.close()
        mixed.close()


def test_unconstrained_requests_never_start_the_process(backend: GrammarBackend) -> None:
    table = GrammarTable(backend, 8, VOCAB, torch.device("cpu"), GrammarProcessMode.LAZY)
    states = [SamplingState.create(SamplingParams(max_tokens=4), i, [1]) for i in range(3)]
    for i, state in enumerate(states):
        table.add(str(i), state)
    assert table.plan(["0", "1", "2"]) is None and table.process is None
    table.close()


def test_a_step_whose_requests_all_ended_takes_no_forced_run_of_the_step_before(backend: GrammarBackend) -> None:
    """Jump-forward's runs are a home's news of its last step: a later step whose requests there have all
    ended (finished or aborted while it was in flight) reports none of them. (A stale run once reached the
    core under another step's rows: a KeyError that killed the engine, or a run given to the wrong request.)"""
    table = GrammarTable(backend, 4, VOCAB, torch.device("cpu"), GrammarProcessMode.OFF, jump_forward=True)
    state = SamplingState.create(SamplingParams(regex="hello world [0-9]", temperature=1.0, max_tokens=24), 0, [1])
    table.add("r", state)
    rng = random.Random(0)

    def step() -> Any:
        plan = table.plan(["r"])
        assert plan is not None
        mask, _ = table.fill(plan, torch.tensor(plan.rows))
        token = _pick(mask.bitmask[mask.mask_rows].numpy()[0], rng)
        return table.follow(plan, ReadyStep(ModelRunnerOutput(sampled_token_ids=[token])))

    first = table.advance(step())
    assert first.forced, "the regex forces the text after its first token"
    in_flight = step()  # planned and drawn before the request ended
    table.remove("r")
    assert table.advance(in_flight).forced is None
    table.close()
