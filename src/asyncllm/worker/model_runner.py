"""`ModelRunner`: one step on one device, in phases (`submit`): prepare (admit, bucket, pad, plan attention,
stage, one upload, the PLACEHOLDER feed), launch the forward pass (a replayed graph or eager, then the
logits), the constrained rows' masks, sample (draw, record each request's latest token, send the ids to the
host). `submit` returns before the device is done, the sampled ids on their way to pinned host memory behind
an event; a PLACEHOLDER input (overlapped scheduling) is fed on the device from the token last sampled for
its request.

What a step uploads is handed over as host data by its owners (inputs, the attention plan, the PLACEHOLDER
feed's indices, the draw's parameters and slots, the mask rows, the adapters' rows: `LoRAManager`) and sent in
the step's one copy (`InputBuffers.flush`). Where steps differ (padding, static plan, graph replay, which rows
reach the LM head) the step's `StepShape` says how. A decode step replayed from a CUDA graph gets its logits
from the graph, and where every sampled row takes the plain draw (`takes_plain_draw`) the draw runs in the
bucket's draw graph right after (`GraphDraw`). A step that scores prompt positions (prompt logprobs) runs the
LM head over them first (`sample/prompt_logprobs.py`), never as a decode-only bucket. A step whose sequences
carry drafts (speculative decoding; drafted by the core, `core/spec/`) verifies them in the sample phase: a
logit row per drafted position, each drawn as it would be without drafts (`spec_verify.py`); such a step is
never a decode bucket, so it runs eagerly or in a mixed graph.

Constrained rows (structured output, `GrammarTable`): their bitmask rows are planned with the inputs and
uploaded by the draw; the matchers fill them when the core reads the last constrained step's tokens
(`ConstrainedRead`), after this step's forward pass was launched (on a tensor-parallel worker, where nobody
reads, the fill does it). Where the device runs steps asynchronously (`defer_masked_draw`) the draw waits for
them either on the device, behind a flag set once they are written (`GrammarTable.awaits`), or held on the
host until the next submit (`HeldDraw`): either way the forward pass runs while the host fills the masks and
does the core's work. Steps without constrained rows pay for none of this.

Knows nothing of requests beyond the plain data the scheduler sends and the sampling state it keeps per
request id; nothing of how the model was loaded or the cache sized. The step's only host sync is reading the
sampled ids back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.models.base import CausalLM
from asyncllm.sample.prompt_logprobs import PromptLogprobsOutput, PromptPlan, PromptScorer, score_prompts
from asyncllm.sample.sampler import DrawInputs, Sampler, takes_plain_draw
from asyncllm.sample.state import SamplingState
from asyncllm.step import ModelRunnerOutput, ReadyStep, SchedulerOutput, StepResult
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.draft_rows import plan_draft_rows
from asyncllm.structured_output.grammar_table import GrammarProcessMode, GrammarTable, MaskPlan
from asyncllm.worker.buckets import StepShape
from asyncllm.worker.cuda_graph import CudaGraphRunner
from asyncllm.worker.draft_model import DraftModel
from asyncllm.worker.eagle3 import Eagle3Drafter
from asyncllm.worker.graph_draw import GraphDraw
from asyncllm.worker.input_batch import InputBuffers, ModelInputs
from asyncllm.worker.latest_tokens import LatestTokens
from asyncllm.worker.lora import LoRAManager
from asyncllm.worker.sampled_outputs import SampledOutputs
from asyncllm.worker.spec_verify import VerifiedRead, VerifyPlan, plan_verify
from asyncllm.worker.step_result import ConstrainedRead, HeldDraw


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
        grammar_slow_fill_s: float | None = None,
        draft: DraftModel | Eagle3Drafter | None = None,
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
            grammar_slow_fill_s,
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
        self.draft = draft  # speculative_config's "draft_model" or "eagle3": follows every step, proposes after it

    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """`submit`, then wait for the step."""
        return self.submit(scheduled).result()

    @torch.inference_mode()
    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        """Launch one step, in its phases; returns before the device is done."""
        # First the draw the last step held: its tokens feed this step, and it reads staged regions (draw
        # parameters, mask rows, slots) that this step's upload overwrites.
        self._launch_held()
        batch = self._prepare(scheduled)
        forward = self._launch_forward(batch)
        if self.draft is not None:  # the draft's KV for the same tokens (draft_model.py, eagle3.py)
            self.draft.follow(scheduled, batch.x)
        masks = self._masks(batch)
        step = self._sample(batch, forward, masks)  # the sample phase verifies the step's drafts (spec_verify.py)
        if self.draft is not None and masks is None:  # its proposals for the next steps, once the tokens are read
            step = self.draft.propose(scheduled, step)
        return step

    def _prepare(self, scheduled: SchedulerOutput) -> StepBatch:
        """Admit the new requests; pad the inputs to the step's shape (its bucket); plan attention; stage
        everything the step uploads and send it in one copy; feed the PLACEHOLDER inputs on the device."""
        self._admit(scheduled)
        sampling = [s.request_id for s in scheduled.seqs if s.sample]
        states = [self.states[r] for r in sampling]
        # Drafts add logit rows, one per drafted position; a constrained one's are masked after the drafts before
        # it (`draft_rows.py`).
        verify = plan_verify(scheduled, states) if scheduled.num_draft_tokens else None
        if verify is not None:
            states = verify.states  # [R] one per logit row
        scoring = self.prompt_scorer.plan(scheduled) if self.prompt_scorer else None
        shape = self.buckets.shape(scheduled, len(states))
        x = self.inputs.prepare(
            scheduled,
            shape.pad_to,
            shape.pad_tokens_to,
            shape.pad_logits_to,
            flush=False,
            verify_drafts=verify is not None,
        )
        plan = self.backend.plan(x.meta, shape.bounds)
        self.inputs.stage_plan(x.meta, plan, static=shape.bounds is not None)
        feed = None
        if x.placeholder_rows:
            feed = self.inputs.staging.stage(
                self._latest.feed_index(x.placeholder_rows, x.placeholder_owners), torch.int64
            )
        draw = None
        if sampling:
            graph_draw = self._graph_draw
            tail = scoring is None and graph_draw is not None and graph_draw.ready() and self.graphs.has_tail(shape)
            draw = self._stage_draw(states, sampling, shape.logit_rows if tail else None, verify, scheduled)
        if self.loras is not None:
            self.loras.stage(scheduled, x.num_tokens, x.meta.query_lens_cpu)
        self.inputs.flush()
        if feed is not None:
            # PLACEHOLDER inputs take the token last sampled for their request, on the device: the sampled
            # ids never wait for the host before they are fed back.
            self._latest.feed(self.inputs.input_ids.dev, feed)
        return StepBatch(x, shape, states, scoring, draw, verify)

    def _stage_draw(
        self,
        states: list[SamplingState],
        sampling: list[str],
        tail: int | None,
        verify: VerifyPlan | None,
        scheduled: SchedulerOutput,
    ) -> StagedDraw:
        """Stage the draw: in the step's draw graph's fixed regions where it has one (`tail`: the graph's rows)
        and every row takes the plain draw; else the eager draw's parameters (a verifying row's noise offset
        its place after the first), the constrained rows' bitmask rows (`GrammarTable.plan`, known before the
        forward pass), the sampled ids' slots and, verifying drafts, each sequence's last row (whose token is
        recorded)."""
        stage = self.inputs.staging.stage
        plan = None  # unless a request with a grammar is live and sampled
        if self.grammars.has_requests:  # (with each sampled row's input: its last draw's token, or known)
            follows = [seq.takes_previous_token for seq in scheduled.seqs if seq.sample]
            plan = self.grammars.plan(sampling, follows, len(scheduled.seqs))
        if tail is not None and plan is None and verify is None and all(map(takes_plain_draw, states)):
            assert self._graph_draw is not None
            self._graph_draw.stage(self.sampler.draw_params(states), self._latest.slots(sampling), tail)
            return StagedDraw(graphed=True)
        params = self.sampler.draw_params(states, plan is not None, verify.ahead if verify is not None else None)
        draw = None
        if params is not None:
            draw = params.on_device(stage(params.counters, torch.int64), stage(params.temperatures, torch.float32))
        rows = None
        if plan is not None:  # verifying: each logit row's, a drafted one's after the drafts before it
            rows = stage(plan.rows if verify is None else plan_draft_rows(plan, verify.drafts), torch.int64)
        last = stage(verify.last, torch.int64) if verify is not None else None
        return StagedDraw(False, draw, stage(self._latest.slots(sampling), torch.int64), plan, rows, last)

    def _launch_forward(self, batch: StepBatch) -> Forward:
        """The forward pass (a replayed graph or eager), then the logits the step reads: the scored prompt
        positions' (prompt logprobs) and the sampled rows' (unless the decode graph draws them itself)."""
        hidden, graph_logits = self.graphs.run(batch.shape, batch.x)  # [x.num_tokens, hidden], padding rows too
        draw = batch.draw
        if draw is not None and draw.graphed:
            # A decode bucket's graphs are captured for every LoRA and attention variant: the LM head ran.
            assert graph_logits is not None
            return Forward(None, None)
        prompt = None
        if batch.scoring is not None:
            compute = self.model.compute_logits
            prompt = score_prompts(batch.scoring, hidden, compute, self.inputs.max_num_seqs, self.buckets.logit_rows)
        if draw is None:
            return Forward(None, prompt)
        n = len(batch.states)
        if graph_logits is not None:  # the decode graph ran the LM head
            logits = graph_logits[:n]  # [S, vocab], static: read before the next step runs
        else:
            x = batch.x
            last_hidden = hidden[x.logits_indices] if batch.shape.gathers_logits else hidden  # [logit_rows, hidden]
            # The LM head runs at a padded row count (`Buckets.logit_rows`): warm-up ran every one of them.
            logits = self.model.compute_logits(last_hidden)[:n]  # [S, vocab]
        return Forward(logits, prompt)

    def _masks(self, batch: StepBatch) -> StepMasks | None:
        """How the constrained rows' masks (planned with the inputs) reach the draw, which uploads them
        (`GrammarTable.fill`). The matchers fill them when the core reads the last constrained step, which on
        a device that runs steps asynchronously comes after this submit returns: there (`defer_masked_draw`)
        the draw waits for them on the host, held until the next submit (or whoever reads this step first),
        unless it can wait on the device (`GrammarTable.awaits`). On CPU the host runs the forward pass
        itself: holding would only add a step."""
        draw = batch.draw
        if draw is None or draw.mask_plan is None:
            return None
        assert draw.mask_rows is not None
        held = self.defer_masked_draw and not self.grammars.awaits(draw.mask_plan)
        return StepMasks(draw.mask_plan, draw.mask_rows, held)

    def _sample(self, batch: StepBatch, forward: Forward, masks: StepMasks | None) -> StepResult:
        """The step's tokens, on their way to the host: drawn by the decode graph's tail, or eagerly now, or
        held with their masks (`HeldDraw`)."""
        draw = batch.draw
        if draw is not None and draw.graphed:
            assert self._graph_draw is not None
            self.graphs.run_tail(batch.shape)  # the draw and the latest-token record, over the graph's logits
            self.sampler.drawn(batch.states)
            return self._outputs.send(self._graph_draw.tokens(len(batch.states)), None)
        if draw is None:
            if forward.prompt is not None:  # prompt chunks that sample nothing yet
                return self._outputs.send(None, None, prompt=forward.prompt)
            return ReadyStep(ModelRunnerOutput(sampled_token_ids=[]))
        if masks is not None and masks.held:
            self._held = HeldDraw(partial(self._draw, batch, forward, masks))
            return self._held
        return self._draw(batch, forward, masks)

    @torch.inference_mode()  # a held draw runs outside `submit`
    def _draw(self, batch: StepBatch, forward: Forward, masks: StepMasks | None) -> StepResult:
        """Draw the step's tokens (constrained rows under their uploaded masks), record them as their requests'
        latest and send them to the host; a constrained step's read hands them to the grammar (`ConstrainedRead`)."""
        draw = batch.draw
        assert draw is not None and draw.slots is not None and forward.logits is not None
        mask = failed = None
        deferred: list[int] = []
        if masks is not None:
            mask, failed = self.grammars.fill(masks.plan, masks.rows)
            deferred = masks.plan.deferred  # rows whose mask is still being filled in the slow lane: no token
        before = batch.verify.before if batch.verify is not None else None
        skip = batch.verify.rows_of(deferred) if batch.verify is not None else deferred  # logit rows
        out = self.sampler(forward.logits, batch.states, draw.params, mask, skip, before)
        # Verifying drafts: each sequence's last row is recorded, the latest token if every draft is accepted (a
        # step chained on this one feeds it; any other next step is planned after the read, from the tokens
        # its request accepted).
        latest = out.token_ids if draw.last is None else out.token_ids.index_select(0, draw.last)
        self._latest.record(draw.slots, latest)
        sent = self._outputs.send(out.token_ids, out.logprobs_output, failed, forward.prompt, deferred or None)
        if batch.verify is not None:  # read first: the grammar's matchers take the accepted runs
            caps = masks.plan.draft_caps if masks is not None else None
            sent = VerifiedRead(sent, batch.verify, self.sampler.penalties.uncount, caps)
        if masks is None:
            return sent
        return ConstrainedRead(sent, self.grammars.follow(masks.plan, sent), self.grammars)

    def _launch_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.start()

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
        self._launch_held()  # it samples rows of states about to go
        if self.prompt_scorer:
            for request_id in request_ids:
                self.prompt_scorer.remove(request_id)
        if self.draft is not None:
            self.draft.forget(request_ids)
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


@dataclass(frozen=True)
class StagedDraw:
    """A sampling step's draw, staged with its inputs: the decode graph's own (`graphed`: its parameters in
    `GraphDraw`'s regions), or an eager draw's parameters, the sampled ids' slots and the mask rows."""

    graphed: bool
    params: DrawInputs | None = None  # the eager draw's parameters
    slots: torch.Tensor | None = None  # [S] int64: each sampled row's latest-token slot (None: graphed)
    mask_plan: MaskPlan | None = None  # where the constrained rows find their masks (`GrammarTable.plan`)
    mask_rows: torch.Tensor | None = None  # [S] int64: each sampled row's bitmask row, -1 where unconstrained
    last: torch.Tensor | None = None  # [S] int64, verifying drafts: each sampled sequence's last logit row


@dataclass(frozen=True)
class StepBatch:
    """A step prepared: its inputs uploaded (and fed), and what the later phases read of it."""

    x: ModelInputs
    shape: StepShape
    states: list[SamplingState]  # the logit rows' states, in row order (a sequence verifying k drafts: k + 1)
    scoring: PromptPlan | None  # the prompt positions whose logprobs the step scores
    draw: StagedDraw | None  # None: the step samples nothing
    verify: VerifyPlan | None = None  # the rows verifying drafts (speculative decoding)


@dataclass(frozen=True)
class Forward:
    """A step's forward pass, launched: the logits its phases read."""

    logits: torch.Tensor | None  # [S, vocab] the sampled rows' (None: no eager draw)
    prompt: PromptLogprobsOutput | None  # the scored prompt positions' logprobs, on their way


@dataclass(frozen=True)
class StepMasks:
    """The constrained rows' masks as the draw will upload them (`GrammarTable.fill`)."""

    plan: MaskPlan
    rows: torch.Tensor  # [S] int64, staged: each sampled row's bitmask row
    held: bool  # the draw waits for them on the host: held until the next submit
