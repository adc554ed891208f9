"""The grammar process against the step thread's matchers, at the runner's `GrammarTable`: the same
requests, steps and tokens give bit-identical masks and the same failures, whether every matcher stays in
the step thread or a lazily started process takes the requests admitted once it is ready (so steps mix
both homes while it starts), its threads each taking a share of a step's rows; and a table whose requests
are all unconstrained never starts it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from asyncllm import SamplingParams
from asyncllm.sample.grammar import GrammarBackend
from asyncllm.sample.state import SamplingState
from asyncllm.sample.structured import GrammarProcessMode, GrammarTable
from asyncllm.step import ModelRunnerOutput, ReadyStep
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
    """Drive `table` through `steps` overlapped steps (each draw held until the next step is planned, its
    tokens read after): `ROWS` requests at a time, each ending at EOS, a refusal or 24 tokens and replaced by
    the next; the first `ROWS` admitted at once, the rest after the process (if any) is ready. Every step's masks
    (in sampled order), tokens and failures."""
    rng = random.Random(seed)
    made = 0

    def admit() -> SamplingState:
        nonlocal made
        spec = SPECS[made % len(SPECS)]
        state = SamplingState.create(SamplingParams(**spec, temperature=1.0, max_tokens=24), made, [1])
        table.add(state)
        made += 1
        return state

    live = [admit() for _ in range(ROWS)]
    table.wait_for_process()  # lazily started by the first add: the next requests' matchers go there
    lengths = {id(s): 0 for s in live}
    seen: list[Any] = []
    held: tuple[Any, list[SamplingState]] | None = None
    pending: tuple[Any, list[SamplingState]] | None = None
    ended: list[SamplingState] = []
    for _ in range(steps):
        if held is not None:
            plan, states = held
            mask, failed = table.fill(plan, torch.tensor(plan.rows))
            rows = mask.bitmask[mask.mask_rows].numpy()
            tokens = [_pick(row, rng) for row in rows]
            seen.append((rows.tobytes(), tokens, failed))
            step = ReadyStep(ModelRunnerOutput(sampled_token_ids=tokens, failed=failed))
            pending = (table.sent(step, plan), states)
        for state in ended:  # gone at the next submit, as the core's finished requests are
            live.remove(state)
            table.remove(state)
        ended = []
        while len(live) < ROWS:
            live.append(admit())
            lengths[id(live[-1])] = 0
        plan = table.plan(live)
        held = (plan, list(live))
        if pending is not None:
            result, states = pending
            output = result.result()
            failed = output.failed or {}
            for i, (state, token) in enumerate(zip(states, output.sampled_token_ids)):
                if state in ended or state not in live:
                    continue
                lengths[id(state)] += 1
                if i in failed or token in backend.stop_token_ids or lengths[id(state)] >= 24:
                    ended.append(state)
            seen.append(sorted(failed.items()))
    return seen


def test_process_gives_the_step_threads_masks_and_failures(backend: GrammarBackend) -> None:
    inline = GrammarTable(backend, ROWS, VOCAB, torch.device("cpu"), GrammarProcessMode.OFF)
    mixed = GrammarTable(backend, ROWS, VOCAB, torch.device("cpu"), GrammarProcessMode.LAZY, process_threads=3)
    try:
        want = _run(inline, backend, 60, seed=3)
        got = _run(mixed, backend, 60, seed=3)
        process = mixed.process
        assert process is not None and process.ready and process.live > 0, "the process serves the later requests"
        assert got == want
        failures = [entry for entry in want if isinstance(entry, list) and entry]
        assert any("no token of the model's vocabulary" in str(e) for f in failures for _, e in f), "a refusal"
    finally:
        inline.close()
        mixed.close()
    assert mixed.process is None


def test_unconstrained_requests_never_start_the_process(backend: GrammarBackend) -> None:
    table = GrammarTable(backend, 8, VOCAB, torch.device("cpu"), GrammarProcessMode.LAZY)
    states = [SamplingState.create(SamplingParams(max_tokens=4), i, [1]) for i in range(3)]
    for state in states:
        table.add(state)
    assert table.plan(states) is None and table.process is None
    table.close()
