"""`ModelRunner`: one step on one device. Turns a `SchedulerOutput` into inputs in persistent buffers, one
forward pass, and one sample per sequence that reached the end of its tokens; `submit` returns before the
device is done, with the sampled ids on their way to pinned host memory behind an event. A PLACEHOLDER
input (overlapped scheduling) is filled on the device from the previous step's sampled ids.

Whenever the attention backend can be captured, decode-only steps are padded to a batch-size bucket and
other steps (prompt chunks, with or without decodes) to a token-count bucket, and planned statically; each
then replays a CUDA graph if one was captured for its bucket, or runs eagerly the same way otherwise: so
graphs and `enforce_eager` compute exactly the same numbers. Steps beyond the largest bucket run eagerly,
unpadded.

Knows nothing of requests beyond the plain data the scheduler sends and the sampling state it keeps per
request id; nothing of how the model was loaded or the cache sized. The step's only host sync is reading
the sampled ids back.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend
from asyncllm.attention.layer import KVCache
from asyncllm.sample.sampler import DrawInputs, Sampler
from asyncllm.sample.state import SamplingState
from asyncllm.step import ModelRunnerOutput, ReadyStep, SchedulerOutput, StepResult
from asyncllm.worker.cuda_graph import CudaGraphRunner, capture_sizes, is_decode_only, token_capture_sizes
from asyncllm.worker.input_batch import InputBuffers, ModelInputs
from asyncllm.worker.latest_tokens import LatestTokens
from asyncllm.worker.sampled_outputs import SampledOutputs


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        buffers: InputBuffers,
        device: torch.device,
        eos_token_ids: frozenset[int],
        max_seq_len: int,
        vocab_size: int,
        max_graph_tokens: int = 0,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.inputs = buffers
        self.device = device
        self.eos_token_ids = eos_token_ids
        # What a step uploads goes out in one copy (`buffers.staging`): the inputs, the decode order, the
        # sampler's parameters and the latest tokens' indices are all written before `buffers.flush()`.
        stage = buffers.staging.stage
        self.sampler = Sampler(vocab_size, device, stage=stage)
        self.states: dict[str, SamplingState] = {}
        self.graphs: CudaGraphRunner | None = None  # set once captured (CUDA, enforce_eager=False)
        self._outputs = SampledOutputs(buffers.max_num_seqs, device)
        # Each live request's latest sampled id, on the device, in a slot of its own: a PLACEHOLDER is filled
        # from it whichever earlier step sampled it (a decode starved of budget skips a step).
        self._latest = LatestTokens(device, stage=stage)
        self.max_seq_len = max_seq_len  # static bound on sequence lengths: decode plans depend on nothing else
        # Padded decode sizes: the CUDA graphs' sizes, also used eagerly when the backend plans statically.
        # A decode step holds at most one token per sequence within the step's token budget.
        max_decode = min(buffers.max_num_seqs, buffers.max_num_tokens)
        self.decode_sizes = capture_sizes(max_decode) if backend.supports_cuda_graphs else []
        # Padded token counts of every other step, up to `max_graph_tokens` (0: none; such steps run unpadded).
        max_tokens = min(max_graph_tokens, buffers.max_num_tokens)
        self.token_sizes = token_capture_sizes(max_tokens) if backend.supports_cuda_graphs else []

    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """`submit`, then wait for the step."""
        return self.submit(scheduled).result()

    @torch.inference_mode()
    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        self.forget(scheduled.finished_request_ids)
        for new in scheduled.new_requests:
            state = SamplingState.create(new.params, new.seed, new.prompt_token_ids, self.eos_token_ids)
            self.sampler.add(state)
            self.states[new.request_id] = state
            self._latest.add(new.request_id)
        seqs = scheduled.seqs
        sampling = [s.request_id for s in seqs if s.sample]
        states = [self.states[r] for r in sampling]
        size = self.decode_size(len(seqs)) if is_decode_only(scheduled) else None
        if size is not None:
            x = self.inputs.prepare(scheduled, pad_to=size, flush=False)  # every row samples
            self.backend.plan_graph_decode(x.meta, size, self.max_seq_len)  # the graph's plan, this step's order
            feed, draw, slots = self._stage(x, states, sampling)
            self._feed_previous(feed)
            if self.graphs is not None and self.graphs.has(size):
                last_hidden = self.graphs.replay(size, size)  # [size, hidden], padding rows included
            else:
                last_hidden = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)
        else:
            tokens = self.token_size(scheduled.num_batched_tokens)
            logit_rows = self.logit_rows(len(sampling))
            x = self.inputs.prepare(scheduled, pad_tokens_to=tokens, pad_logits_to=logit_rows, flush=False)
            feed, draw, slots = self._stage(x, states, sampling)
            self._feed_previous(feed)
            if tokens is None:
                self.backend.prepare(x.meta)
                hidden = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)  # [T, hidden]
            else:
                self.backend.plan_graph_mixed(x.meta, tokens, self.inputs.max_num_seqs, self.max_seq_len)
                if self.graphs is not None and self.graphs.has_mixed(tokens):
                    hidden = self.graphs.replay_mixed(tokens)  # [tokens, hidden], padding rows last
                else:
                    hidden = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)
            if not sampling:
                return ReadyStep(ModelRunnerOutput(sampled_token_ids=[]))
            last_hidden = hidden[x.logits_indices]
        # The LM head runs at a padded row count: cuBLAS prepares a kernel per new row count on first use
        # (milliseconds, up to ~350 ms once on the H200), and warm-up ran every padded count, never others.
        logits = self.model.compute_logits(last_hidden)[: len(sampling)]  # [S, vocab]
        out = self.sampler(logits, states, draw)
        if slots is not None:
            self._latest.record(slots, out.token_ids)
        return self._outputs.send(out.token_ids, out.logprobs_output)

    def _stage(
        self, x: ModelInputs, states: list[SamplingState], sampling: list[str]
    ) -> tuple[torch.Tensor | None, DrawInputs | None, torch.Tensor | None]:
        """Stage the rest of what the step uploads (the PLACEHOLDER feed's indices, the draw's parameters, the
        sampled ids' slots), then send it all with the inputs in one copy."""
        feed = self._latest.feed_index(x.placeholder_rows, x.placeholder_owners) if x.placeholder_rows else None
        draw = self.sampler.stage(states) if sampling else None
        slots = self._latest.slots(sampling) if sampling else None
        self.inputs.flush()
        return feed, draw, slots

    def _feed_previous(self, feed: torch.Tensor | None) -> None:
        """Replace each PLACEHOLDER input with the token last sampled for that request, on the device: the
        sampled ids never wait for the host before they are fed back."""
        if feed is not None:
            self._latest.feed(self.inputs.input_ids.dev, feed)

    def decode_size(self, num_seqs: int) -> int | None:
        """The padded size a decode-only step of `num_seqs` runs at; None for steps that run unpadded and
        eagerly."""
        if not self.decode_sizes:
            return None
        i = bisect.bisect_left(self.decode_sizes, num_seqs)
        return self.decode_sizes[i] if i < len(self.decode_sizes) else None

    def logit_rows(self, num_sampling: int) -> int:
        """Rows the LM head runs at for a step sampling `num_sampling` sequences: the next decode bucket (the
        counts warm-up ran), or exactly `num_sampling` where there are no buckets."""
        i = bisect.bisect_left(self.decode_sizes, num_sampling)
        return self.decode_sizes[i] if num_sampling and i < len(self.decode_sizes) else num_sampling

    def token_size(self, num_tokens: int) -> int | None:
        """The padded token count a step of `num_tokens` that is not decode-only runs at; None for steps run
        unpadded."""
        if not self.token_sizes:
            return None
        i = bisect.bisect_left(self.token_sizes, num_tokens)
        return self.token_sizes[i] if i < len(self.token_sizes) else None

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of requests the scheduler will never mention again (finished, or warm-up's)."""
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.sampler.remove(state)
                self._latest.remove(request_id)

    def shutdown(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self.kv_caches = []
        self.states.clear()
