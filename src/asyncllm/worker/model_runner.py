"""`ModelRunner`: one step on one device. Turns a `SchedulerOutput` into inputs in persistent buffers, one
forward pass (a CUDA graph replay for decode-only steps when graphs were captured, eager otherwise), and
one sample per sequence that reached the end of its known tokens.

Knows nothing of requests beyond the plain data the scheduler sends and the sampling state it keeps per
request id; nothing of how the model was loaded or the cache sized. The step's only host sync is reading
the sampled ids back.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend
from asyncllm.attention.layer import KVCache
from asyncllm.executor.interface import ModelRunnerOutput, SchedulerOutput
from asyncllm.sample.sampler import Sampler
from asyncllm.sample.state import SamplingState
from asyncllm.worker.cuda_graph import CudaGraphRunner
from asyncllm.worker.input_batch import InputBuffers


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        buffers: InputBuffers,
        device: torch.device,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.inputs = buffers
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.states: dict[str, SamplingState] = {}
        self.graphs: CudaGraphRunner | None = None  # set once captured (CUDA, enforce_eager=False)

    @torch.inference_mode()
    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduled.finished_request_ids:
            self.states.pop(request_id, None)
        for new in scheduled.new_requests:
            self.states[new.request_id] = SamplingState.create(
                new.params, new.seed, new.prompt_token_ids, self.device, self.eos_token_ids
            )
        sampling = [s.request_id for s in scheduled.seqs if s.sample]
        size = self.graphs.padded_size(scheduled) if self.graphs is not None else None
        if size is not None and self.graphs is not None:
            self.inputs.prepare(scheduled, pad_to=size)
            last_hidden = self.graphs.replay(size, len(scheduled.seqs))  # [S, hidden]: every row samples
        else:
            x = self.inputs.prepare(scheduled)
            self.backend.prepare(x.meta)
            hidden = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)  # [T, hidden]
            if not sampling:
                return ModelRunnerOutput(sampled_token_ids=[])
            last_hidden = hidden[x.logits_indices]
        logits = self.model.compute_logits(last_hidden)  # [S, vocab]
        states = [self.states[r] for r in sampling]
        out = self.sampler(logits, states)
        token_ids: list[int] = out.token_ids.tolist()  # the step's one host sync
        for state, token in zip(states, token_ids):
            state.record(token)
        return ModelRunnerOutput(sampled_token_ids=token_ids, logprobs=out.logprobs)

    def forget(self, request_ids: list[str]) -> None:
        """Drop per-request state the scheduler will never mention again (warm-up's throwaway requests)."""
        for request_id in request_ids:
            self.states.pop(request_id, None)

    def shutdown(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self.kv_caches = []
        self.states.clear()
