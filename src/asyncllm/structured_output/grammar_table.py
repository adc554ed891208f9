"""Structured output in the runner: the constrained requests' grammars (`RequestGrammar` handles, their
matchers in a `MatcherHome`), and per step the token bitmask of the constrained rows it samples.

Per constrained step, in the runner's phases: `plan` (when its inputs are staged) points each constrained row
at a bitmask row; `fill` (just before the draw) uploads the rows; `follow` (the draw launched) makes the
step's `FillJob` (`mask_fill.py`); `advance` (when its tokens are read: by the core, or by the next fill
where nobody reads, as on tensor-parallel workers) hands them to the matchers' homes, which accept them and
fill each request's next row. So a step's masks are mostly filled before its draw is due: `plan` points a
row at the one the last job fills for its request, or at a row of its own after those for a request the job
did not cover (new, or one that skipped a step), which `fill` asks for, before it waits for every home's
rows. The matchers see every token in order: a job accepts only after the previous one's rows were drawn from.

Where matchers live (`GrammarProcessMode`): in the step thread (`InlineMatchers`), or in the grammar process
(`grammar_process.py`), which does the accepting and filling beside the step thread; requests admitted while
that process starts keep theirs in the step thread for their whole life, so one step may mix both (and, with
the process started lazily, so do requests that may jump forward while few constrained requests are live).
On one CUDA rank with shared rows the draw does not wait on the host at all (`awaits`): it is queued at once
behind a device-side wait per home for that home's flag of the rows, which the home sets once it has
written them (`stream_wait.py`). If the
process dies, its requests end with its error and new ones stay in the step thread. Knows nothing of models
or scheduling.
"""

from __future__ import annotations

import os
import platform

import numpy as np
import torch

from asyncllm.errors import AsyncLLMError
from asyncllm.sample.features import may_jump
from asyncllm.sample.sampler import TokenMask
from asyncllm.sample.state import SamplingState
from asyncllm.step import ModelRunnerOutput, StepResult
from asyncllm.structured import StructuredOutput
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.deferral import settle_lane_rows
from asyncllm.structured_output.draft_rows import fill_draft_rows
from asyncllm.structured_output.fill_costs import FillCosts
from asyncllm.structured_output.grammar_process import GrammarProcess
from asyncllm.structured_output.host_rows import HostRows, RowsLayout, RowsSegment, host_row_sets
from asyncllm.structured_output.mask_fill import JUMP_MAX_ROWS, DeviceMasks, FillJob, MarkTicket, MaskPlan, by_home
from asyncllm.structured_output.matcher_set import MAX_FILL_THREADS
from asyncllm.structured_output.process_mode import GrammarProcessMode
from asyncllm.structured_output.request_grammar import InlineMatchers, MatcherHome, RequestGrammar
from asyncllm.structured_output.stream_wait import StreamWaiter

__all__ = ["GrammarProcessMode", "GrammarTable", "MaskPlan", "RequestGrammar"]

_PROCESS, _STEP_THREAD = 0, 1  # whose flags: the grammar process's rows, the step thread's


class GrammarTable:
    """The runner's constrained requests, by request id: `add`/`remove` them; per constrained step `plan`,
    `fill`, `follow`, `advance`."""

    def __init__(
        self,
        backend: GrammarBackend | None,
        max_rows: int,
        vocab_size: int,
        device: torch.device,
        process: GrammarProcessMode = GrammarProcessMode.OFF,
        process_threads: int | None = None,
        jump_forward: bool = False,
        awaited_masks: bool = False,
        slow_fill_s: float | None = None,
    ) -> None:
        """`process_threads`: how many of the grammar process's threads share a step's rows (None: the cores
        this process may use, less two for the step thread and the device's driver, at most `MAX_FILL_THREADS`).
        `jump_forward`: requests whose matcher is in the step thread and that ask for no logprobs or
        penalties output their constraint's forced text without draws (`FillJob`, `jump_forward.py`).
        `awaited_masks`: once the rows are shared (a grammar process may run), a step queues its draw at once,
        behind device-side waits for its rows' flags, one a home: the grammar process's and the step thread's
        (`awaits`; CUDA, one rank, and an x86 host, whose stores reach others in order: each home writes its
        flag after its rows). `slow_fill_s`: a request whose matcher costs the step thread more than this a row
        (accept and fill, on average) moves to the slow lane, where its rows sit draws out until filled
        (`fill_costs.py`, `deferral.py`; one rank only: every rank must defer alike). None: no lane."""
        self.backend = backend
        self.jump_forward = jump_forward
        self.device = device
        self._max_rows = max_rows
        self._words = -(-vocab_size // 32)
        self._grammars: dict[str, RequestGrammar] = {}  # by request id; while empty, a step looks at no row
        self._last: FillJob | None = None  # the last constrained step's job
        self._costs = FillCosts(slow_fill_s) if slow_fill_s is not None else None
        self._inline = InlineMatchers(backend, self._words, self._costs)
        if backend is None or not hasattr(os, "memfd_create"):
            process = GrammarProcessMode.OFF  # nothing to compile with, or no shared memory to fill
        self._process_mode = process
        cores = len(os.sched_getaffinity(0))
        self._process_threads = process_threads or max(1, min(MAX_FILL_THREADS, cores - 2))
        self._process: GrammarProcess | None = None
        # Two sets of host rows that jobs alternate between (a job fills one while the other's upload may
        # still be in flight), each with room for a job's rows and as many more; shared with the grammar
        # process where there may be one. Allocated at the first constrained step (or the process's start).
        self._hosts: list[HostRows] = []
        self._segment: RowsSegment | None = None
        self._flip = 0
        self._device_masks: DeviceMasks | None = None
        self._wants_awaited = awaited_masks and device.type == "cuda"
        self._awaited_masks = self._wants_awaited and platform.machine() in ("x86_64", "AMD64")
        self._waiter: StreamWaiter | None = None  # opened with the shared rows, where awaited masks may be
        self._flag_at: list[list[int]] = []  # each home's flag of each set, as the device addresses them
        self._epochs = [[0, 0], [0, 0]]  # each home's last mark for each set: the flag values waited for
        if process is GrammarProcessMode.EAGER:
            self._start_process()

    @property
    def has_requests(self) -> bool:
        """Some live request has a grammar (else no step is constrained)."""
        return bool(self._grammars)

    @property
    def process(self) -> GrammarProcess | None:
        """The grammar process, once started (None: matchers in the step thread only)."""
        return self._process

    def add(self, request_id: str, state: SamplingState) -> None:
        """A new request: a grammar for it if its parameters ask for one (its `state.constrained`)."""
        spec = state.params.structured
        if spec is None:
            return
        jumps = self.jump_forward and may_jump(state.params)
        home = self._home(jumps, spec)
        if home is self._inline:
            slot = self._inline.add(spec, jumps)
            jumps = jumps and not self._inline.in_lane(slot)  # the lane's requests draw every token
            grammar = RequestGrammar(spec.field, home, slot, jumps, state)
        else:
            grammar = RequestGrammar(spec.field, home, home.add(spec))
        self._grammars[request_id] = grammar

    def remove(self, request_id: str) -> None:
        grammar = self._grammars.pop(request_id, None)
        if grammar is not None:
            grammar.removed = True
            grammar.home.remove(grammar.slot)

    def plan(self, request_ids: list[str], follows: list[bool] | None = None, num_seqs: int = 0) -> MaskPlan | None:
        """Each sampled row's bitmask row (the rows' requests in order); None when no row is constrained.
        Known before the forward pass. `follows`, `num_seqs`: see `MaskPlan` (for the slow lane's rows)."""
        if not self._grammars:
            return None
        source = self._last
        index = source.index if source is not None else {}
        base = len(index)
        get = self._grammars.get
        grammars = [get(r) for r in request_ids]  # comprehensions: a step may have hundreds of rows
        constrained = [(i, grammar) for i, grammar in enumerate(grammars) if grammar is not None]
        if source is not None and not source.accepted:
            source.sampled_next = constrained  # its jumping rows' next draws are under way (FillJob)
        if not constrained:
            return None
        row_of = index.get
        rows = [-1 if grammar is None else row_of(grammar, -2) for grammar in grammars]  # -2: not in the job
        lane = self._inline.lane
        if lane is not None and lane.live:  # the lane's rows are its own copies, taken at `fill` (deferral.py)
            for i, grammar in constrained:
                if grammar.home is self._inline and grammar.slot in lane:
                    rows[i] = -2
        extras: list[tuple[int, RequestGrammar]] = []
        if -2 in rows:
            for i, grammar in constrained:
                if rows[i] == -2:
                    rows[i] = base + len(extras)
                    extras.append((rows[i], grammar))
        follows = follows if follows is not None else [False] * len(rows)
        return MaskPlan(rows, source, extras, constrained, base + len(extras), follows=follows, num_seqs=num_seqs)

    @property
    def waits_on_device(self) -> bool:
        """Constrained draws may wait for their rows on the device (`awaits`): the rows are shared, on CUDA."""
        return self._waiter is not None

    def awaits(self, plan: MaskPlan) -> bool:
        """Whether `fill` queues the plan's draw behind device-side waits for its rows (the grammar process
        alive where it holds some of them) rather than waiting for the rows on the host."""
        if self._waiter is None:
            return False
        process = self._process
        if process is None or not any(grammar.home is process for _, grammar in plan.constrained):
            return True
        if not process.ready:
            return False
        if not process.alive():
            self._release_flags(_PROCESS)
            return False
        return True

    def fill(self, plan: MaskPlan, mask_rows: torch.Tensor) -> tuple[TokenMask, dict[int, str | AsyncLLMError] | None]:
        """The step's bitmask, uploaded (the plan's job has its rows under way; the extras are asked for
        here, and every home's rows waited for, on the host or, where `awaits`, by the device); and the rows
        whose request cannot go on, by row (its constraint failed to compile or refused a token, or its
        matcher was lost with the grammar process)."""
        if self.awaits(plan):
            return self._fill_awaited(plan, mask_rows)
        device_masks = self._buffers()
        if plan.source is not None:
            self.advance(plan.source)  # its rows under way (from here, where nobody read its step)
            host = plan.source.host
        else:
            host = self._hosts[self._flip]
            host.writable()
        settle_lane_rows(plan, host, self._inline, None)
        if plan.extras:
            for home, (rows, slots) in by_home(plan.extras).items():
                home.fill(host, rows, slots)
        if plan.drafted:  # after every token of theirs was accepted (the source's, above)
            fill_draft_rows(host, plan)
        self._collect(plan, host)
        failed: dict[int, str | AsyncLLMError] = {
            i: grammar.error for i, grammar in plan.constrained if grammar.error is not None
        }
        return TokenMask(device_masks.upload(host, plan.num_rows), mask_rows), failed or None

    def _fill_awaited(
        self, plan: MaskPlan, mask_rows: torch.Tensor
    ) -> tuple[TokenMask, dict[int, str | AsyncLLMError] | None]:
        """`fill` without waiting: the extras asked for now; each home with rows in the step sets its flag of
        them to a new mark once they are written (when the core reads the job's step, or now if it has), and
        the upload is queued behind the device's waits for those marks. The errors those fills find fail
        their requests when this step is read (`FillJob`); those known now, now."""
        waiter = self._waiter
        assert waiter is not None
        device_masks = self._buffers()
        source = plan.source
        host = source.host if source is not None else self._hosts[self._flip]
        host.writable()  # the last upload from these rows preceded a step whose tokens are in
        settle_lane_rows(plan, host, self._inline, source)
        for home, (rows, slots) in by_home(plan.extras).items():
            home.fill(host, rows, slots)
            if not home.beside:  # the step thread's errors are known now (its earlier ones too: kept on
                errors = home.collect()  # the grammars, for the job that reads them, `FillJob._late_errors`)
                for _, grammar in plan.constrained:
                    if grammar.home is home and grammar.slot in errors:
                        grammar.error = grammar.error or errors[grammar.slot]
        if plan.drafted:  # a drafted request's last token is in (its step was read): before any home's mark
            fill_draft_rows(host, plan)
        ticket = MarkTicket()
        waits = []
        for home in {grammar.home for _, grammar in plan.constrained if not grammar.removed}:
            kind = _PROCESS if home.beside else _STEP_THREAD
            marks = self._epochs[kind]
            mark = marks[host.index] = (marks[host.index] + 1) & 0xFFFFFFFF or 1  # 0 is "no mark"
            if source is not None and not source.accepted:
                source.marks[home] = (mark, ticket)  # set once the job's tokens are in and its rows written
                plan.after = source
            else:
                home.mark(host, mark)
                if home.beside:
                    ticket.seq = home.last_seq
            waits.append((self._flag_at[kind][host.index], mark))
        plan.ticket = ticket
        failed: dict[int, str | AsyncLLMError] = {
            i: grammar.error for i, grammar in plan.constrained if grammar.error is not None
        }
        for address, mark in waits:
            waiter.wait(address, mark)
        return TokenMask(device_masks.upload(host, plan.num_rows), mask_rows), failed or None

    def _release_flags(self, kind: int | None = None) -> None:
        """Let every wait queued on the device for `kind`'s flags (None: both) pass, and any queued later: the
        grammar process is gone, so no mark of its will come (its requests end with its failure: `FillJob`),
        or the engine is closing."""
        if self._segment is not None and self._flag_at:
            sets = len(self._epochs[0])
            for k in (_PROCESS, _STEP_THREAD) if kind is None else (kind,):
                for index, mark in enumerate(self._epochs[k]):
                    self._segment.flags[k * sets + index] = (mark + (1 << 30)) & 0xFFFFFFFF

    def follow(self, plan: MaskPlan, tokens: StepResult) -> FillJob:
        """The step `plan` masked has its draw launched (`tokens`: its sampled ids on their way): its job, whose
        rows the next step's plan points at, filled when the step's tokens are read (`advance`)."""
        self._flip ^= 1
        job = FillJob(tokens, plan.constrained, self._hosts[self._flip], len(plan.rows))
        job.ticket, job.after = plan.ticket, plan.after
        self._last = job
        return job

    def advance(self, job: FillJob) -> ModelRunnerOutput:
        """The grammar's phase after a constrained step's draw: wait for the step's tokens, hand them to the
        matchers (which fill the next step's rows, or have the grammar process do it) and return the step's
        output with the refusals and forced runs found at once (`FillJob.accept`). Once per job: later calls
        return the same output."""
        return job.accept()

    def wait_for_process(self, timeout: float | None = None) -> bool:
        """Block until a grammar process being started is ready (or could not start); True if one is."""
        return self._process is not None and self._process.wait_ready(timeout)

    def close(self) -> None:
        if self._process is not None:
            self._process.close()  # reaped: no flag of its changes after this
            self._process = None
        self._release_flags()  # nothing queued on the device may wait for a mark that will not come
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _home(self, jumps: bool, spec: StructuredOutput) -> MatcherHome:
        """Where a request admitted now keeps its matcher: the grammar process once it is ready. With the
        process started lazily (the default) and draws that wait on the device, a request that may jump
        forward stays in the step thread while fewer than `JUMP_MAX_ROWS` constrained requests are live:
        jumps are taken only at such sizes, where they beat the draws (batch 1: 1.2-1.5x), and the step
        thread's few rows cost little; the process takes the many rows that would load the step thread. A
        constraint found slow stays here, for the slow lane."""
        process = self._process
        if self._costs is not None:
            for found in process.take_slow() if process is not None else ():  # found slow in the process
                self._costs.mark_slow(found)
            if self._costs.is_slow(spec):
                return self._inline
        if process is not None and process.ready and process.alive():
            few = jumps and len(self._grammars) < JUMP_MAX_ROWS and self._waiter is not None
            if few and self._process_mode is GrammarProcessMode.LAZY:
                return self._inline
            return process
        if process is None and self._process_mode is GrammarProcessMode.LAZY:
            self._start_process()  # the first constrained request: in the background, this one stays here
        return self._inline

    def _start_process(self) -> None:
        self._host_rows()
        assert self.backend is not None and self._segment is not None
        if self._process_mode is GrammarProcessMode.LAZY and self._wants_awaited and self._waiter is None:
            # No device-side waits here (not an x86 host, or the driver refused): the process's draws would
            # wait for its rows on the host, slower than the step thread (bench/RESULTS.md run 69).
            self._process_mode = GrammarProcessMode.OFF
            return
        self._process = GrammarProcess(
            self.backend,
            self._segment,
            self._process_threads,
            lambda: self._release_flags(_PROCESS),
            self._costs.bound_s if self._costs is not None else None,
        )
        self._process.start()

    def _collect(self, plan: MaskPlan, host: HostRows) -> None:
        """Wait for every home's rows; note the errors they report on the plan's grammars."""
        for home in (self._process, self._inline):
            if home is None:
                continue
            errors = home.collect()
            if errors:
                for _, grammar in plan.constrained:
                    if grammar.home is home and grammar.slot in errors:
                        grammar.error = errors[grammar.slot]
        process = self._process
        if process is not None and process.failure is not None:
            self._lost(process, plan, host)

    def _lost(self, process: GrammarProcess, plan: MaskPlan, host: HostRows) -> None:
        """The grammar process died: its requests in this step fail with its error (their rows, perhaps half
        written, allow any token: a failed request's is never output); no new request goes there."""
        self._process_mode = GrammarProcessMode.OFF
        for i, grammar in plan.constrained:
            if grammar.home is process:
                grammar.error = grammar.error or process.failure
                host.bits_np[plan.rows[i]] = -1
                host.states_np[plan.rows[i]] = 0
        if process.live == 0:  # its last request is gone
            process.close()
            self._process = None

    def _host_rows(self) -> None:
        if not self._hosts:
            layout = RowsLayout(2, 2 * self._max_rows, self._words)
            shared = self._process_mode is not GrammarProcessMode.OFF
            self._hosts, self._segment = host_row_sets(layout, self.device, shared)
            segment = self._segment
            if segment is not None and segment.pinned and self._awaited_masks:
                self._waiter = StreamWaiter.open(segment.flag_address(0))
                if self._waiter is not None:
                    at = self._waiter.device_address
                    sets = layout.sets
                    self._flag_at = [[at(segment.flag_address(k * sets + i)) for i in range(sets)] for k in range(2)]
                    self._inline.flags = segment.flags[_STEP_THREAD * sets :]

    def _buffers(self) -> DeviceMasks:
        if self._device_masks is None:
            self._host_rows()
            # Without a backend every constrained request fails at its first step: any UTF-8 table will do.
            utf8 = self.backend.utf8.allowed if self.backend is not None else np.full((8, self._words), -1, np.int32)
            self._device_masks = DeviceMasks(2 * self._max_rows, self._words, utf8, self.device)
        return self._device_masks
