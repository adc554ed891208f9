"""The forward passes of an embed or score engine's steps: every scheduled sequence is a whole input, and
the pass returns every token's hidden state, packed [T, hidden].

Decoders (Qwen3-Embedding, the Qwen3-Reranker) take the generation path's paged prefill (`PagedForward`),
not a varlen attention of their own: the same kernels (on CUDA the fused norm/rotary/KV-write kernel and the
Triton attention, on CPU the torch reference), already tested against transformers, and no second attention
path to keep for them. Its KV cache is one layer deep, shared by every layer: a whole input's attention reads
only the keys its own step wrote, so each layer may write its keys over the previous layer's and attend to
them before the next layer does the same. The cache then holds the tokens of the steps in flight for one
layer (2 steps of the step budget: `pooling_setup.py`), not a generation engine's every layer; blocks are
freed when the step's output is read. Beside a varlen attention with causal=True, the paged path adds only
each layer's KV write (a copy of k and v into that cache), small beside the projections (not measured apart).

Encoders (BERT) have no cache at all (`EncoderForward`): their own forward over `EncoderBatch`, through the
varlen attention (attention/varlen.py), positions from 0 in each sequence and the requests' token types.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.attention.layer import KVCache
from asyncllm.attention.varlen import EncoderBatch
from asyncllm.models.base import CausalLM, EncoderModel
from asyncllm.step import SchedulerOutput
from asyncllm.worker.input_batch import InputBuffers


class PagedForward:
    """A decoder's forward over whole sequences through the paged prefill path, with a one-layer cache."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, buffers: InputBuffers, layer: KVCache) -> None:
        self.model = model
        self.backend = backend
        self.inputs = buffers
        self.kv_caches: list[KVCache] = [layer] * model.arch.num_layers  # one (k, v) pair, every layer's

    def __call__(self, scheduled: SchedulerOutput, token_type_ids: list[tuple[int, ...] | None]) -> torch.Tensor:
        x = self.inputs.prepare(scheduled, flush=False)  # unpadded: a pooling step runs eagerly
        plan = self.backend.plan(x.meta, None)
        self.inputs.stage_plan(x.meta, plan, static=False)
        self.inputs.flush()
        hidden: torch.Tensor = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)  # [T, hidden]
        return hidden

    def release(self) -> None:
        self.kv_caches = []


class EncoderForward:
    """An encoder's forward over whole sequences: no cache, one host-to-device copy of the step's inputs."""

    def __init__(self, model: EncoderModel, device: torch.device) -> None:
        self.model = model
        self.device = device

    def __call__(self, scheduled: SchedulerOutput, token_type_ids: list[tuple[int, ...] | None]) -> torch.Tensor:
        seqs = scheduled.seqs
        lens = [s.num_tokens for s in seqs]
        ids = np.fromiter((t for s in seqs for t in s.input_token_ids), dtype=np.int64, count=sum(lens))
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        types = np.zeros(len(ids), dtype=np.int64)
        start = 0
        for n, tt in zip(lens, token_type_ids):
            if tt is not None:
                types[start : start + n] = tt
            start += n
        host = torch.from_numpy(np.stack([ids, positions, types]))  # [3, T]
        inputs = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        batch = EncoderBatch.from_seq_lens(lens, self.device)
        hidden: torch.Tensor = self.model(inputs[0], inputs[1], inputs[2], batch)  # [T, hidden]
        return hidden

    def release(self) -> None:
        pass
