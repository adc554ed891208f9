"""`EngineCore`: one step of continuous batching at a time, driven by whoever owns the device.

Owns the scheduler, block manager and output processing; drives a `ModelExecutor` it is given. With
`async_scheduling` (the default) a step plans and submits step N+1 before it waits for step N, so the host's
planning and output processing overlap the device's work; step N+1 feeds step N's tokens in on the device
(PLACEHOLDER inputs), and a request that finished at N has its token of N+1 dropped. Serial scheduling, the
slow twin, waits for each step before planning the next. The async layer calls it from its step thread,
`LLM` from the caller's thread. A request of n > 1 samples becomes n requests sharing its prompt's blocks
(`sample_group.py`); their deltas go out under the request's id, by sample index. A request asking for
prompt logprobs keeps what each step scored of its prompt (`ModelRunnerOutput.prompt_logprobs`) and hands
them out whole on its first token's delta. LoRA adapters are added and removed between steps (`add_lora`,
`remove_lora`: `lora.py`). With speculative decoding (`spec/speculation.py`) a step's output may carry several
tokens for a request, appended and stop-checked one by one. No torch, no asyncio; time comes from the
injected clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from tokenizers import Tokenizer

from asyncllm.config_speculative import SpeculativeConfig
from asyncllm.core.block_manager import BlockManager
from asyncllm.core.deadlines import Deadlines
from asyncllm.core.engine_stats import EngineStats
from asyncllm.core.kv_tiers import stop_executor
from asyncllm.core.lora import AdapterBudget, LoRARegistry, LoRASettings
from asyncllm.core.output_processor import OutputProcessor, RequestDelta, request_metrics
from asyncllm.core.pooling import finish_pooled
from asyncllm.core.request import Request
from asyncllm.core.sample_group import SampleGroups
from asyncllm.core.scheduler import Scheduler, SchedulerLimits
from asyncllm.core.spec.speculation import Speculation
from asyncllm.core.window_blocks import WindowedBlockManager
from asyncllm.errors import AsyncLLMError, InvalidRequestError, RequestTimeoutError
from asyncllm.outputs import FinishReason
from asyncllm.step import ModelExecutor, ModelRunnerOutput, SchedulerOutput, StepResult


@dataclass(frozen=True)
class StepCounts:
    """Tokens one step computed, for progress bars and throughput figures."""

    num_prefill_tokens: int
    num_decode_tokens: int


@dataclass(frozen=True)
class _Launched:
    """A step handed to the executor whose outputs are not processed yet."""

    scheduled: SchedulerOutput
    result: StepResult
    mark: int  # the block manager's registration mark after planning it
    counts: StepCounts


class EngineCore:
    def __init__(
        self,
        executor: ModelExecutor,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_tokens_while_decoding: int | None = None,
        enable_prefix_caching: bool,
        seed: int,
        tokenizer: Tokenizer | None,
        clock: Callable[[], float],
        async_scheduling: bool = True,
        max_cpu_loras: int | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.executor = executor
        rt = executor.runtime
        self.block_manager = (
            BlockManager(rt.num_kv_blocks, rt.block_size, enable_prefix_caching, rt.kv_tiers)
            if rt.kv_window is None
            else WindowedBlockManager(rt.num_kv_blocks, rt.block_size, enable_prefix_caching, rt.kv_window, rt.kv_tiers)
        )
        self.loras = LoRARegistry(LoRASettings(rt.max_loras, max_cpu_loras))
        self.groups = SampleGroups()
        self.deadlines = Deadlines()
        self.speculation = Speculation(speculative) if speculative is not None else None
        self.scheduler = Scheduler(
            SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_prefill_tokens_while_decoding),
            self.block_manager,
            AdapterBudget(rt.max_loras) if rt.max_loras else None,
            self.groups,
            self.speculation,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._clock = clock
        self._seed_rng = random.Random(seed)
        self.last_step = StepCounts(0, 0)
        self.num_steps = 0
        self.async_scheduling = async_scheduling
        self._in_flight: _Launched | None = None
        self.last_step_idle = False
        self.graphs_pending = rt.cuda_graphs_pending  # lazy capture's (0 once all are captured: not asked again)
        # Requests whose first step the last `step()` planned (their prompt started computing): the async
        # front stops counting them as waiting. Replaced by every call, so nobody has to read it.
        self.last_started: tuple[str, ...] = ()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a checked request. With `params.n` > 1 it runs as n samples; with `params.seed=s`, sample i
        draws from seed s + i (as a request of its own with that seed would); else each draws its own."""
        params = request.params
        if request.lora_name is not None:
            request.lora_id = self.loras.resolve(request.lora_name)  # an unknown name fails this request alone
        request.speculative = self.speculation is not None and self.speculation.eligible(request)  # its samples' too
        if params.n > 1:
            group = self.groups.create(request, self.block_manager.block_size, self.scheduler.requests)
            for i, sample in enumerate(group.samples):
                self._queue(sample, params.seed + i if params.seed is not None else None)
            return
        if self.groups.get(request.request_id) is not None:
            raise InvalidRequestError(f"request_id={request.request_id!r} is already live: give another id")
        self._queue(request, params.seed)

    def _queue(self, request: Request, seed: int | None) -> None:
        self.scheduler.add_request(request, seed if seed is not None else self._seed_rng.getrandbits(63))
        self.output_processor.add_request(request)
        if request.deadline is not None:
            self.deadlines.add(request.request_id, request.deadline)

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter on every rank and register it as `name` (`LoRAError`: nothing changed)."""
        self.loras.add(name, path, self.executor.add_lora)

    def remove_lora(self, name: str) -> None:
        """Forget adapter `name`; `LoRAError` while a live request (waiting or running) uses it."""
        users = (r.lora_id for r in self.scheduler.requests.values())
        self.loras.remove(name, users, self.executor.remove_lora)

    def lora_names(self) -> list[str]:
        return self.loras.names()

    def abort(self, request_id: str) -> list[RequestDelta]:
        """End a live request with "abort" and free its blocks: its final deltas (one per sample still
        running), none if it is unknown or already finished."""
        group = self.groups.get(request_id)
        if group is None:
            delta = self._finish(request_id, "abort", flush=True)
            return [] if delta is None else [delta]
        deltas = [d for s in group.samples if (d := self._finish(s.request_id, "abort", flush=True)) is not None]
        self.groups.label(deltas)
        return deltas

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """`abort`'s last delta (a request's only one, unless it has several samples); None if none."""
        return deltas[-1] if (deltas := self.abort(request_id)) else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def idle_work(self) -> bool:
        """Nothing runs: capture one CUDA graph lazy capture left for later; whether one is still pending."""
        if self.graphs_pending:
            self.graphs_pending = self.executor.pending_graphs(capture_one=not self.has_unfinished())
        return self.graphs_pending > 0

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            prefix_cache_queried_tokens=bm.num_queried_tokens,
            prefix_cache_hit_tokens=bm.num_hit_tokens,
            prefix_cache_host_hit_tokens=bm.num_host_hit_tokens,
            prefix_cache_disk_hit_tokens=bm.num_disk_hit_tokens,
            cuda_graphs_pending=self.graphs_pending and self.executor.pending_graphs(),  # steps capture too
            **(self.speculation.stats() if self.speculation else {}),
        )

    # ------------------------------------------------------------------ the step
    def step(self, after_execute: Callable[[], None] | None = None) -> list[RequestDelta]:
        """Plan and launch the next step, then turn the oldest launched step's tokens into deltas.

        Serially (or with an executor that finished the step at once) that is the step just launched; with
        async scheduling on a device that runs steps asynchronously it is the one launched by the previous
        call, which ran while this one was planned. `after_execute` runs once that step's output is in and
        before it is processed: the step thread applies aborts that arrived meanwhile there, so an aborted
        request gets no token from that step (tokens of requests finished after planning are dropped) and
        its blocks are freed exactly once.
        """
        self.last_started = ()
        deltas = self._expire() if self.deadlines else []  # before planning: they take no further step
        scheduled = self.scheduler.schedule()
        launched = self._launch(scheduled) if not scheduled.is_empty else None
        for step in self._due(launched):  # the oldest in flight first
            output = self._read(step)  # waits for its tokens
            if after_execute is not None:
                after_execute()
            deltas += self._update(step, output)
        return deltas

    def _expire(self) -> list[RequestDelta]:
        """End the requests whose deadline has passed, waiting or running, as an abort would, freeing their
        blocks: "timeout" for one that has output; one that has none (no sample of it has) fails with
        `RequestTimeoutError`."""
        now = self._clock()
        deltas: list[RequestDelta] = []
        for request_id in self.deadlines.due(now):
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue  # finished before its deadline
            group = self.groups.get(request.group_id) if request.group_id is not None else None
            samples = group.samples if group is not None else [request]
            waited = now - request.arrival_time
            delta = self._finish(request_id, "timeout", flush=True)
            assert delta is not None
            if not any(s.num_output_tokens for s in samples):
                delta.error = RequestTimeoutError(
                    f"request {group.request_id if group else request_id!r} gave no output within its timeout "
                    f"({waited:.3g} s after it was added): ended"
                )
            deltas.append(delta)
        if self.groups:
            self.groups.label(deltas)
        return deltas

    def _launch(self, scheduled: SchedulerOutput) -> _Launched:
        """Hand a planned step to the executor, which starts it and returns before the device is done."""
        # A decode extends past the prompt; a one-token prefill chunk (the recomputed last token after a
        # full prefix hit) is still prefill. The scheduler counted them as it planned.
        decode = self.scheduler.num_decodes_planned
        try:
            result = self.executor.submit(scheduled)
        except BaseException:
            # Blocks registered for this step never received their KV: no later request may hit them.
            self.block_manager.discard_pending()
            raise
        self.num_steps += 1
        if scheduled.new_requests:
            self.last_started = tuple(new.request_id for new in scheduled.new_requests)
        counts = StepCounts(scheduled.num_batched_tokens - decode, decode)
        return _Launched(scheduled, result, self.block_manager.pending_mark(), counts)

    def _due(self, launched: _Launched | None) -> list[_Launched]:
        """The steps whose tokens this call reads, oldest first: the one in flight since the last call, and
        `launched` unless it stays in flight (async scheduling, its tokens not in yet: the next call reads it)."""
        due = [self._in_flight] if self._in_flight is not None else []
        self._in_flight = None
        if launched is not None:
            if self.async_scheduling and not launched.result.done():
                self._in_flight = launched
            else:
                due.append(launched)
        if not due:
            self.last_step = StepCounts(0, 0)
        # Nothing launched and nothing read: the caller may wait a little instead of spinning (a step
        # launched but not finished yet is progress: its output comes with the next call).
        self.last_step_idle = launched is None and not due
        return due

    def _read(self, step: _Launched) -> ModelRunnerOutput:
        """Wait for a step's tokens (a constrained step's go to its grammar then, in the worker). Its KV is
        written: the blocks its planning registered may now be hit."""
        try:
            output = step.result.result()
        except BaseException:
            self.block_manager.discard_pending()
            self._in_flight = None
            raise
        self.block_manager.commit_pending(step.mark, output.kv_loaded)
        return output

    def _update(self, step: _Launched, output: ModelRunnerOutput) -> list[RequestDelta]:
        """The step's tokens into the requests and out as deltas (stops checked, text detokenized)."""
        now = self._clock()
        self.last_step = step.counts
        if output.pooled is not None:  # an embed or score step: each request ends with its vector
            return finish_pooled(step.scheduled, output.pooled, partial(self._finish, flush=True))
        deltas: list[RequestDelta] = []
        if output.failed:  # finished first, so their tokens are dropped below like any finished request's
            deltas += self._fail(step.scheduled, output.failed)
        if output.prompt_logprobs:  # before the tokens: a step that ends a prompt scores it and samples after it
            self._add_prompt_logprobs(output.prompt_logprobs)
        all_logprobs = output.logprobs
        forced, accepted = output.forced, output.accepted
        if output.deferred:
            self._sit_out(step.scheduled, output.deferred)
        for request, token_id, index in self.scheduler.update_from_output(step.scheduled, output.sampled_token_ids):
            if request.first_token_time is None:
                request.first_token_time = now
                prompt_logprobs = request.prompt_logprobs  # they go out once, with the first token
            else:
                prompt_logprobs = None
            text, reason = self.output_processor.process_token(request, token_id)
            delta = RequestDelta(request.request_id, [token_id], text)
            if accepted is not None and reason is None and index in accepted:  # verified drafts, then its own
                reason = self._append_run(request, accepted[index], delta)
            if forced is not None and reason is None and index in forced:  # what the grammar forces after those
                reason = self._append_forced(request, forced[index], delta)
            token_logprobs = all_logprobs[index] if all_logprobs is not None else None
            if token_logprobs is not None:
                delta.logprobs = [token_logprobs]
                if output.accepted_logprobs is not None and index in output.accepted_logprobs:
                    # One entry per output token: the accepted run's, cut where the run was.
                    run = output.accepted_logprobs[index][: len(delta.new_token_ids) - 1]
                    delta.logprobs += [entry for entry in run if entry is not None]
            if prompt_logprobs is not None:
                delta.prompt_logprobs = prompt_logprobs
                request.prompt_logprobs = None  # whole: the runner scores each position once
            if reason is not None:
                self._finish(request.request_id, reason, flush=False)
                delta.finish_reason = reason
                delta.metrics = request_metrics(request, now)
            deltas.append(delta)
        if self.speculation is not None:  # verified drafts, and a draft model's next proposals
            self.speculation.settle(step.scheduled, output, self.scheduler.requests)
        if self.groups:
            self.groups.label(deltas)
        return deltas

    def _append_forced(self, request: Request, run: list[int], delta: RequestDelta) -> FinishReason | None:
        """Output a forced run (jump-forward) after `delta`'s token, each token checked as a drawn one is
        (stop tokens and strings, max_tokens: the run is cut where the request ends); the finish reason."""
        if run and request.num_output_tokens < request.max_tokens:
            self.scheduler.start_forced_run(request)
        return self._append_run(request, run, delta)

    def _append_run(self, request: Request, run: list[int], delta: RequestDelta) -> FinishReason | None:
        """Output `run` after `delta`'s token, each token checked as a drawn one is: cut where the request
        ends (stop tokens and strings, max_tokens); the finish reason."""
        run = run[: request.max_tokens - request.num_output_tokens]
        reason = None
        for token_id in run:
            request.append_token(token_id)
            text, reason = self.output_processor.process_token(request, token_id)
            delta.new_token_ids.append(token_id)
            delta.new_text += text
            if reason is not None:
                break
        return reason

    def _add_prompt_logprobs(self, scored: dict[str, list[dict[int, float]]]) -> None:
        """Keep what a step scored of each prompt (`ModelRunnerOutput.prompt_logprobs`) until its first token."""
        requests = self.scheduler.requests
        for request_id, entries in scored.items():
            request = requests.get(request_id)
            if request is not None and request.prompt_logprobs is not None:  # else it ended meanwhile
                request.prompt_logprobs.extend(entries)

    def _finish(self, request_id: str, reason: FinishReason, *, flush: bool) -> RequestDelta | None:
        request = self.scheduler.finish_request(request_id, reason)
        if request is None:
            return None
        request.finish_time = self._clock()
        text = self.output_processor.flush(request_id)
        if not flush:
            return None
        return RequestDelta(request_id, [], text, reason, request_metrics(request, request.finish_time))

    def _sit_out(self, scheduled: SchedulerOutput, deferred: list[int]) -> None:
        """Rows whose draw sat out (by sample index): their requests get no token (`Request.sit_out`)."""
        sampling = [seq.request_id for seq in scheduled.seqs if seq.sample]
        for index in deferred:
            request = self.scheduler.requests.get(sampling[index])
            if request is not None and not request.num_drawn_ahead:  # else dropped already: it followed one sat out
                request.sit_out()

    def _fail(self, scheduled: SchedulerOutput, failed: dict[int, str | AsyncLLMError]) -> list[RequestDelta]:
        """End the requests the executor could not sample for (`ModelRunnerOutput.failed`, by sample index):
        "abort" with their error, without the token they were given; the text held back so far goes out."""
        sampling = [seq.request_id for seq in scheduled.seqs if seq.sample]
        deltas = []
        for index, error in failed.items():
            request = self.scheduler.requests.get(sampling[index])
            if request is None:
                continue  # finished meanwhile (aborted, or stopped by the step before)
            group = self.groups.get(request.group_id) if request.group_id is not None else None
            if group is not None:  # the constraint is the request's: every sample ends, this one last
                for sample in group.samples:
                    if sample is not request and (d := self._finish(sample.request_id, "abort", flush=True)):
                        deltas.append(d)
            delta = self._finish(request.request_id, "abort", flush=True)
            assert delta is not None
            delta.error = error
            deltas.append(delta)
        return deltas

    def shutdown(self) -> None:
        stop_executor(self.executor, self.block_manager.tiers)  # a disk tier first keeps the free cached blocks

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)`, from any thread, when the executor fails between steps (see ModelExecutor)."""
        self.executor.watch_failure(callback)
