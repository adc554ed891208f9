"""`ModelRunner`: one step on one device, one path for every step: bucket, pad, plan, stage, flush, feed,
run, logits, sample, record. `submit` returns before the device is done, with the sampled ids on their way
to pinned host memory behind an event. A PLACEHOLDER input (overlapped scheduling) is fed on the device
from the token last sampled for its request.

What the step uploads (its inputs, the attention plan's work list, the PLACEHOLDER feed's indices, the
draw's parameters, the sampled ids' slots) is handed over as host data by its owners and staged here, then
sent in the step's one copy (`InputBuffers.flush`). Where steps differ (padding, static plan, graph replay,
which rows reach the LM head) the step's `StepShape` says how.

A step that samples constrained rows (structured output) also stages which bitmask row each one reads
(`GrammarTable.plan`): mostly rows the previous constrained step's job filled when the core read that step's
tokens (the matchers took them then, in the grammar process beside this thread, or here: `grammar_process`).
Where the device runs steps asynchronously (`defer_masked_draw`) the draw itself is held back (`HeldDraw`)
until the next `submit` (or whoever reads the step's result first):
the forward pass runs while the host feeds the matchers, fills the masks and does the core's work, and the
draw goes out just before the next forward pass, its masks ready. Where every constrained row's matcher is in
the grammar process (one rank, an x86 host: `GrammarTable.awaits`), the draw goes out at once instead, behind
a wait on the device for its rows' flag, which the process sets once it has written them (`stream_wait.py`):
the host never waits for the rows, and the device only where they come after the forward pass. Steps
without constrained rows pay for none of this.

A step that computes prompt positions of a request asking for prompt logprobs also runs the LM head over
those rows (`sample/prompt_logprobs.py`: in slices of at most `max_num_seqs` rows, the sampler's own size,
padded to the counts warm-up ran), before the sampled rows' logits, and their logprobs travel with the step's
tokens; such steps are never decode-only buckets, and a replayed graph's output rows are read before the next
step runs. Steps without such a request check one empty dict.

A decode step replayed from a CUDA graph gets its logits from the graph (the LM head runs inside it), and
when every sampled row takes the plain draw (`takes_plain_draw`) the draw and the latest-token record run
in the bucket's draw graph right after (`GraphDraw`, its parameters in fixed staged regions): such a step
launches two graph replays and the copy of its ids to the host. Other steps sample eagerly as before.

With LoRA adapters (`LoRAManager`) the step also stages which rows use which adapter slot, loading adapters
into slots first; a step without adapter rows stages nothing more.

Knows nothing of requests beyond the plain data the scheduler sends and the sampling state it keeps per
request id; nothing of how the model was loaded or the cache sized. The step's only host sync is reading
the sampled ids back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.models.base import CausalLM
from asyncllm.sample.prompt_logprobs import PromptLogprobsOutput, PromptScorer, score_prompts
from asyncllm.sample.sampler import DrawInputs, Sampler, takes_plain_draw
from asyncllm.sample.state import SamplingState
from asyncllm.step import ModelRunnerOutput, ReadyStep, SchedulerOutput, StepResult
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.grammar_table import GrammarProcessMode, GrammarTable, MaskPlan
from asyncllm.worker.cuda_graph import CudaGraphRunner
from asyncllm.worker.graph_draw import GraphDraw
from asyncllm.worker.input_batch import InputBuffers, ModelInputs
from asyncllm.worker.latest_tokens import LatestTokens
from asyncllm.worker.lora import LoRAManager
from asyncllm.worker.sampled_outputs import SampledOutputs


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        buffers: InputBuffers,
        graphs: CudaGraphRunner,
        device: torch.device,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        grammar: GrammarBackend | None = None,
        defer_masked_draw: bool = False,
        loras: LoRAManager | None = None,
        grammar_process: GrammarProcessMode = GrammarProcessMode.OFF,
        grammar_process_threads: int | None = None,
        jump_forward: bool = False,
        graph_draw: bool = False,
        awaited_masks: bool = False,
    ) -> None:
        self.model = model
        self.backend = backend
        self.inputs = buffers
        self.graphs = graphs
        self.buckets = graphs.buckets
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(vocab_size, device)
        self.grammars = GrammarTable(
            grammar,
            buffers.max_num_seqs,
            vocab_size,
            device,
            grammar_process,
            grammar_process_threads,
            jump_forward,
            awaited_masks,
        )
        self.states: dict[str, SamplingState] = {}
        self._outputs = SampledOutputs(buffers.max_num_seqs, device)
        # Each live request's latest sampled id, on the device, in a slot of its own: a PLACEHOLDER is filled
        # from it whichever earlier step sampled it (a decode starved of budget skips a step). Room for the
        # preempted requests too: the draw graphs record into this tensor, which keeps its address until full.
        self._latest = LatestTokens(device, capacity=max(256, 4 * buffers.max_num_seqs))
        # `graph_draw`: decode graphs draw plain steps' tokens (their regions declared now, before first use).
        self._graph_draw = (
            GraphDraw(buffers.staging, buffers.max_num_seqs, self._latest, self.sampler.draw) if graph_draw else None
        )
        # Hold a constrained step's draw until the next submit (see the module docstring): where steps run
        # asynchronously (CUDA). On CPU the host runs the forward pass itself: holding would only add a step.
        self.defer_masked_draw = defer_masked_draw
        self._held: HeldDraw | None = None
        self.prompt_scorer = PromptScorer()  # requests whose prompt logprobs are still being scored
        self.loras = loras

    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """`submit`, then wait for the step."""
        return self.submit(scheduled).result()

    @torch.inference_mode()
    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        # First the draw the last step held back: its tokens feed this step, and it reads staged regions
        # (draw parameters, mask rows, slots) that this step's upload overwrites.
        self._release_held()
        self._admit(scheduled)
        sampling = [s.request_id for s in scheduled.seqs if s.sample]
        states = [self.states[r] for r in sampling]
        scoring = self.prompt_scorer.plan(scheduled) if self.prompt_scorer else None
        shape = self.buckets.shape(scheduled, len(sampling))
        # The inputs, padded to the shape, into their staged regions.
        x = self.inputs.prepare(scheduled, shape.pad_to, shape.pad_tokens_to, shape.pad_logits_to, flush=False)
        plan = self.backend.plan(x.meta, shape.bounds)
        self.inputs.stage_plan(x.meta, plan, static=shape.bounds is not None)
        graph_draw = self._graph_draw
        tail = scoring is None and graph_draw is not None and graph_draw.ready() and self.graphs.has_tail(shape)
        feed, draw, slots, masks, graphed = self._stage(x, states, sampling, shape.logit_rows if tail else None)
        if self.loras is not None:
            self.loras.stage(scheduled, x.num_tokens, x.meta.query_lens_cpu)
        self.inputs.flush()
        if feed is not None:
            # PLACEHOLDER inputs take the token last sampled for their request, on the device: the sampled
            # ids never wait for the host before they are fed back.
            self._latest.feed(self.inputs.input_ids.dev, feed)
        hidden, graph_logits = self.graphs.run(shape, x)  # [x.num_tokens, hidden], padding rows included
        if graphed:
            # A decode bucket's graphs are captured for every LoRA and attention variant: the LM head ran.
            assert graph_draw is not None and graph_logits is not None
            self.graphs.run_tail(shape)  # the draw and the latest-token record, over the graph's logits
            self.sampler.drawn(states)
            return self._outputs.send(graph_draw.tokens(len(sampling)), None)
        prompt = None
        if scoring is not None:
            compute = self.model.compute_logits
            prompt = score_prompts(scoring, hidden, compute, self.inputs.max_num_seqs, self.buckets.logit_rows)
        if slots is None:
            if prompt is not None:  # prompt chunks that sample nothing yet
                return self._outputs.send(None, None, prompt=prompt)
            return ReadyStep(ModelRunnerOutput(sampled_token_ids=[]))
        if graph_logits is not None:  # the decode graph ran the LM head
            logits = graph_logits[: len(sampling)]  # [S, vocab], static: read before the next step runs
        else:
            last_hidden = hidden[x.logits_indices] if shape.gathers_logits else hidden  # [shape.logit_rows, hidden]
            # The LM head runs at a padded row count (`Buckets.logit_rows`): warm-up ran every one of them.
            logits = self.model.compute_logits(last_hidden)[: len(sampling)]  # [S, vocab]

        def sample() -> StepResult:
            return self._sample(logits, states, draw, slots, masks, prompt)

        if masks is not None and self.defer_masked_draw and not self.grammars.awaits(masks[0]):
            self._held = HeldDraw(sample)
            return self._held
        return sample()

    @torch.inference_mode()
    def _sample(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        draw: DrawInputs | None,
        slots: torch.Tensor,
        masks: tuple[MaskPlan, torch.Tensor] | None,
        prompt: PromptLogprobsOutput | None = None,
    ) -> StepResult:
        """Draw the step's tokens (the forward pass is launched); constrained rows get their masks first,
        and the step's tokens go to their matchers when they reach the host (`GrammarTable`)."""
        mask = failed = None
        if masks is not None:
            mask, failed = self.grammars.fill(*masks)
        out = self.sampler(logits, states, draw, mask)
        self._latest.record(slots, out.token_ids)
        result = self._outputs.send(out.token_ids, out.logprobs_output, failed, prompt)
        if masks is not None:
            result = self.grammars.sent(result, masks[0])
        return result

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.start()

    def _stage(self, x: ModelInputs, states: list[SamplingState], sampling: list[str], tail: int | None) -> _Staged:
        """Stage the rest of what the step uploads: the PLACEHOLDER feed's indices, the draw's parameters,
        the sampled ids' slots and the constrained rows' bitmask rows, with their plan (None where the step
        has none). `tail`: the rows of the step's draw graph, if it has one: a step whose rows all take the
        plain draw stages its draw in the graph's fixed regions instead (`graphed`)."""
        stage = self.inputs.staging.stage
        feed = None
        if x.placeholder_rows:
            feed = stage(self._latest.feed_index(x.placeholder_rows, x.placeholder_owners), torch.int64)
        if not sampling:
            return _Staged(feed, None, None, None, False)
        plan = self.grammars.plan(sampling)  # None unless a request with a grammar is live and sampled
        if tail is not None and plan is None and all(map(takes_plain_draw, states)):
            assert self._graph_draw is not None
            self._graph_draw.stage(self.sampler.draw_params(states), self._latest.slots(sampling), tail)
            return _Staged(feed, None, None, None, True)
        params = self.sampler.draw_params(states, masked=plan is not None)
        draw = None
        if params is not None:
            draw = params.on_device(stage(params.counters, torch.int64), stage(params.temperatures, torch.float32))
        masks = (plan, stage(plan.rows, torch.int64)) if plan is not None else None
        return _Staged(feed, draw, stage(self._latest.slots(sampling), torch.int64), masks, False)

    def capture_graphs(self) -> float:
        """Capture the CUDA graphs (with the plain draw's per decode bucket, where this runner has one);
        returns the seconds it took."""
        return self.graphs.capture(self._graph_draw.launch if self._graph_draw is not None else None)

    def _admit(self, scheduled: SchedulerOutput) -> None:
        """Drop finished requests' state, and make the new requests'."""
        self.forget(scheduled.finished_request_ids)
        for new in scheduled.new_requests:
            state = SamplingState.create(new.params, new.seed, new.prompt_token_ids, self.eos_token_ids)
            self.sampler.add(state)
            self.grammars.add(new.request_id, state)
            self.states[new.request_id] = state
            self._latest.add(new.request_id)
            if new.params.prompt_logprobs is not None:
                self.prompt_scorer.add(new.request_id, new.prompt_token_ids, new.params.prompt_logprobs)
            if new.lora_id:
                assert self.loras is not None, "a request with an adapter reached an engine without enable_lora"
                self.loras.add_request(new.request_id, new.lora_id)

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of requests the scheduler will never mention again (finished, or warm-up's)."""
        self._release_held()  # it samples rows of states about to go
        if self.prompt_scorer:
            for request_id in request_ids:
                self.prompt_scorer.remove(request_id)
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.sampler.remove(state)
                self.grammars.remove(request_id)
                self._latest.remove(request_id)
                if self.loras is not None:
                    self.loras.remove_request(request_id)

    @property
    def grammar(self) -> GrammarBackend | None:
        """The constraints' compiler over this model's vocabulary (None without a tokenizer or EOS ids)."""
        return self.grammars.backend

    def shutdown(self) -> None:
        self.grammars.close()  # first: a draw queued behind its rows' flag must not hold the syncs below
        self._held = None
        self.graphs.release()
        self.states.clear()
        if self.grammars.backend is not None:
            self.grammars.backend.close()


class _Staged(NamedTuple):
    feed: torch.Tensor | None  # the PLACEHOLDER feed's indices
    draw: DrawInputs | None  # the eager draw's parameters
    slots: torch.Tensor | None  # the sampled rows' latest-token slots (None: nothing to sample eagerly)
    masks: tuple[MaskPlan, torch.Tensor] | None  # the constrained rows' bitmask plan and rows
    graphed: bool  # the step's draw is its decode graph's (staged in `GraphDraw`'s regions)


class HeldDraw:
    """A step whose draw waits on the host for its bitmask: `start()` fills the mask and launches the draw
    (once; the runner does it at the next submit), `result()` starts it if nobody has, then waits."""

    __slots__ = ("_error", "_sample", "_sent")

    def __init__(self, sample: Callable[[], StepResult]) -> None:
        self._sample: Callable[[], StepResult] | None = sample
        self._sent: StepResult | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        if self._sample is not None:
            sample, self._sample = self._sample, None
            try:
                self._sent = sample()
            except BaseException as exc:  # whoever reads the result later gets it too
                self._error = exc
                raise

    def done(self) -> bool:
        return self._error is not None or (self._sent is not None and self._sent.done())

    def result(self) -> ModelRunnerOutput:
        self.start()
        if self._error is not None:
            raise self._error
        assert self._sent is not None
        return self._sent.result()
