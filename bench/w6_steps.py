"""W6's host side as steps: 256 constrained rows per decode step driven through the runner's `GrammarTable`
in the order the engine drives it on CUDA (the held draw launched at the next submit, then the step's forward
pass, then the previous step's tokens read and handed to the matchers, then the core's own host work), against
a simulated device: a forward pass is a busy device for `forward_ms`, the draw for `draw_ms`, and reading a
step's tokens waits (sleeping, as a CUDA event wait does) until the simulated device has drawn them. The
core's host work is `host_ms` of Python holding the GIL.

The tokens are a random walk over what the masks allow (a random-weight model's outputs), recorded once with
the step thread's matchers, then replayed identically for each variant, so every variant does the same
matcher work: `plain` (no grammar: the unconstrained run's step), `inline` (matchers in the step thread) and
`process` (the grammar process). The masks' upload costs no host time on CUDA (a DMA): the replays skip
it. Importable (`run_steps`); `w6_host.py` prints its figures.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm import SamplingParams
from asyncllm.sample.state import SamplingState
from asyncllm.step import ModelRunnerOutput
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.grammar_table import GrammarProcessMode, GrammarTable, MaskPlan
from asyncllm.structured_output.mask_fill import DeviceMasks, FillJob

MAX_TOKENS = 256  # a request that has not closed its JSON by then ends ("length") and a new one takes its row


class SimDevice:
    """A device that runs launches in order, each busy for its time; `now` is the host's clock."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def launch(self, ms: float) -> float:
        """Queue `ms` of work; when it will be done."""
        self.free_at = max(time.perf_counter(), self.free_at) + ms / 1000
        return self.free_at


class SimStep:
    """A launched draw's result: its tokens once the simulated device has drawn them."""

    def __init__(self, tokens: list[int], ready_at: float) -> None:
        self._output = ModelRunnerOutput(sampled_token_ids=tokens)
        self._ready_at = ready_at

    def done(self) -> bool:
        return time.perf_counter() >= self._ready_at

    def start(self) -> None:
        pass

    def result(self) -> ModelRunnerOutput:
        wait = self._ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self._output


def busy(ms: float) -> None:
    """The core's host work: Python holding the GIL for `ms`."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


@dataclass
class Walk:
    """Per step, the rows' request ids in order and the token each drew; which requests start each step."""

    rows: list[list[int]]
    tokens: list[list[int]]


def _pick(row: np.ndarray, rng: random.Random) -> int:
    """A token the mask row allows, uniformly (a random-weight model's draw is nearly that)."""
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    return int(allowed[rng.randrange(len(allowed))])


def _states(params: SamplingParams, n: int, first: int) -> list[SamplingState]:
    return [SamplingState.create(params, seed=first + i, prompt_token_ids=[1]) for i in range(n)]


def _drive(
    table: GrammarTable | None,
    params: SamplingParams,
    rows: int,
    steps: int,
    draw: Callable[[int, MaskPlan | None, torch.Tensor | None, list[int]], list[int]],
    timing: tuple[float, float, float],
    stop_ids: set[int],
) -> tuple[float, float]:
    """Run `steps` steps in the engine's overlapped order; wall seconds per step, and the step thread's CPU
    seconds per step (the host work the grammar leaves on it).
    `draw(step, plan, bitmask, ids)` gives the step's tokens (the walk's, or chosen from the masks)."""
    forward_ms, draw_ms, host_ms = timing
    device = SimDevice()
    states: dict[int, SamplingState] = {}
    order: list[int] = []
    next_id = 0
    finished: list[int] = []  # ended at the step just read: removed at the next submit (as the core does)
    lengths: dict[int, int] = {}
    ended: set[int] = set()
    held: tuple[int, MaskPlan | None, list[int]] | None = None
    pending: SimStep | None = None
    job: FillJob | None = None  # the pending step's grammar follow-up, when it was masked
    pending_ids: list[int] = []
    start = cpu = 0.0
    for step in range(steps + 1):
        if step == 2:  # the first steps admit every request and compile the schema (in the process too)
            start, cpu = time.perf_counter(), time.thread_time()
        # submit: the held draw first, then admissions, the plan and the forward pass
        if held is not None:
            k, plan, ids = held
            bitmask = None
            if table is not None and plan is not None:
                mask, _ = table.fill(plan, torch.tensor(plan.rows, dtype=torch.int64))
                bitmask = mask.bitmask
            tokens = draw(k, plan, bitmask, ids)
            result = SimStep(tokens, device.launch(draw_ms))
            job = table.follow(plan, result) if table is not None and plan is not None else None
            pending = result
            pending_ids = ids
        for request_id in finished:
            order.remove(request_id)
            states.pop(request_id)
            if table is not None:
                table.remove(str(request_id))
        finished = []
        while len(order) < rows:
            state = SamplingState.create(params, seed=next_id, prompt_token_ids=[1])
            if table is not None:
                table.add(str(next_id), state)
            states[next_id] = state
            order.append(next_id)
            lengths[next_id] = 0
            next_id += 1
        ids = list(order)
        plan = table.plan([str(i) for i in ids]) if table is not None else None
        device.launch(forward_ms)
        held = (step, plan, ids)
        # read the previous step's tokens (a masked step's go to the matchers), then the core's own work
        if pending is not None:
            output = table.advance(job) if table is not None and job is not None else pending.result()
            for request_id, token in zip(pending_ids, output.sampled_token_ids):
                if request_id in ended:
                    continue  # its token of the step planned before its end is dropped
                lengths[request_id] += 1
                if token in stop_ids or lengths[request_id] >= MAX_TOKENS:
                    finished.append(request_id)
                    ended.add(request_id)
        busy(host_ms)
    return (time.perf_counter() - start) / (steps - 1), (time.thread_time() - cpu) / (steps - 1)


def run_steps(
    backend: GrammarBackend,
    schema: dict[str, object],
    *,
    rows: int = 256,
    steps: int = 100,
    forward_ms: float = 2.5,
    draw_ms: float = 0.15,
    host_ms: float = 2.0,
    seed: int = 0,
) -> dict[str, float]:
    """ms per step of each variant, and their ratios to `plain` (the W1-style figure the host allows)."""
    params = SamplingParams(json_schema=schema, max_tokens=MAX_TOKENS)
    stop_ids = set(backend.stop_token_ids)
    timing = (forward_ms, draw_ms, host_ms)
    rng = random.Random(seed)
    walk: dict[tuple[int, int], int] = {}  # (step, request id) -> token

    def choose(step: int, plan: MaskPlan | None, bitmask: torch.Tensor | None, ids: list[int]) -> list[int]:
        assert plan is not None and bitmask is not None
        masks = bitmask.numpy()
        tokens = [_pick(masks[plan.rows[i]], rng) for i in range(len(ids))]
        walk.update(((step, request_id), token) for request_id, token in zip(ids, tokens))
        return tokens

    def replay(step: int, plan: MaskPlan | None, bitmask: torch.Tensor | None, ids: list[int]) -> list[int]:
        return [walk[step, request_id] for request_id in ids]

    def table(mode: GrammarProcessMode) -> GrammarTable:
        return GrammarTable(backend, rows, backend.vocab_size, torch.device("cpu"), mode)

    recorder = table(GrammarProcessMode.OFF)
    _drive(recorder, params, rows, steps, choose, (0.0, 0.0, 0.0), stop_ids)
    recorder.close()
    # On CUDA the masks' upload is a DMA behind the step (no host time): the replays skip it.
    DeviceMasks.upload = lambda self, host, n: self.bits[:n]  # type: ignore[method-assign]
    out: dict[str, float] = {}

    def timed(name: str, grammars: GrammarTable | None) -> None:
        wall, cpu = _drive(grammars, params, rows, steps, replay, timing, stop_ids)
        out[f"{name}_ms"], out[f"{name}_thread_cpu_ms"] = 1000 * wall, 1000 * cpu
        if grammars is not None:
            grammars.close()

    timed("plain", None)
    timed("inline", table(GrammarProcessMode.OFF))
    process = table(GrammarProcessMode.EAGER)
    t0 = time.perf_counter()
    assert process.wait_for_process(), "the grammar process did not start"
    out["process_start_s"] = time.perf_counter() - t0
    timed("process", process)
    out["inline_ratio"] = out["plain_ms"] / out["inline_ms"]
    out["process_ratio"] = out["plain_ms"] / out["process_ms"]
    return {key: round(value, 3) for key, value in out.items()}
