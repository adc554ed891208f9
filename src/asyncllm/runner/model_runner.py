"""`ModelRunner`: the `ModelExecutor` on one device. Loads the model, sizes and owns the KV cache, turns
each `SchedulerOutput` into one forward pass and one sample per finished sequence.

Knows nothing of requests beyond the plain data the scheduler sends and the sampling state it keeps per
request id; the step's only host sync is reading the sampled ids back.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import AttentionBackendName, EngineConfig, LoadFormat
from asyncllm.core.runtime import RuntimeInfo
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class
from asyncllm.runner.checkpoint import Checkpoint
from asyncllm.runner.device import resolve_device, resolve_dtype
from asyncllm.runner.input_batch import InputBuffers
from asyncllm.runner.kv_cache import KVCacheSpec, allocate_kv_cache, blocks_for_budget
from asyncllm.runner.sampler import Sampler, SamplingState

logger = logging.getLogger(__name__)


def make_attention_backend(
    choice: AttentionBackendName, device: torch.device, dtype: torch.dtype, num_kv_heads: int
) -> AttentionBackend:
    """The backend for `choice`: "torch" is the reference, "triton" the paged Triton kernels (on CUDA, or on
    CPU in Triton's interpreter when TRITON_INTERPRET=1 was set before the first import of triton).

    "auto": Triton on CUDA when triton is installed (its kernels, backend and engine-level greedy parity passed
    on the H200: bench/RESULTS.md), else the torch reference (CPU, where the reference is fast enough and exact).
    """
    if choice is AttentionBackendName.AUTO:
        choice = AttentionBackendName.TORCH
        if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            choice = AttentionBackendName.TRITON
    if choice is AttentionBackendName.TORCH:
        from asyncllm.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    if choice is AttentionBackendName.TRITON:
        from asyncllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device, dtype, num_kv_heads)
    raise ValueError(f"attention_backend={choice.value!r} is not available in this version; use 'torch' or 'triton'")


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint.hf_config)
        model_cls = resolve_model_class(checkpoint.hf_config)
        self.arch = ModelArchConfig.from_hf(checkpoint.hf_config, config.max_model_len)
        max_model_len = self.arch.max_model_len
        self.backend = make_attention_backend(config.attention_backend, self.device, self.dtype, self.arch.num_kv_heads)
        with torch.device(self.device):
            model = model_cls(self.arch, self.backend)
        # Cast before loading: weights are copied (and cast) into place, never held twice on the device.
        self.model = model.to(dtype=self.dtype).eval()
        if config.load_format is LoadFormat.DUMMY:
            _fill_dummy_weights(self.model, config.seed)
        else:
            self.model.load_weights(checkpoint.iter_weights())
        self.kv_spec = KVCacheSpec(
            num_layers=self.arch.num_layers,
            num_kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
        )
        num_blocks = self._decide_num_blocks(max_model_len)
        if num_blocks * config.block_size < max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: longer requests are refused and "
                "outputs stop ('length') when a sequence fills it; raise num_kv_blocks (or GPU memory) to avoid it",
                num_blocks * config.block_size,
                max_model_len,
            )
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        self._runtime = RuntimeInfo(
            vocab_size=self.arch.vocab_size,
            max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            eos_token_ids=checkpoint.eos_token_ids,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
        )
        max_blocks_per_seq = -(-min(max_model_len, num_blocks * config.block_size) // config.block_size)
        self.inputs = InputBuffers(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_blocks_per_seq,
            config.block_size,
            self.device,
        )
        self.sampler = Sampler()
        self.states: dict[str, SamplingState] = {}
        logger.info(
            "KV cache: %d blocks of %d tokens (%s, %s)",
            num_blocks,
            config.block_size,
            self.device,
            self.dtype,
        )

    @property
    def runtime(self) -> RuntimeInfo:
        return self._runtime

    @torch.inference_mode()
    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduled.finished_request_ids:
            self.states.pop(request_id, None)
        for new in scheduled.new_requests:
            self.states[new.request_id] = SamplingState.create(
                new.params, new.seed, new.prompt_token_ids, self.device, self._runtime.eos_token_ids
            )
        x = self.inputs.prepare(scheduled)
        self.backend.prepare(x.meta)
        hidden = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)  # [T, hidden]
        sampling = [s.request_id for s in scheduled.seqs if s.sample]
        if not sampling:
            return ModelRunnerOutput(sampled_token_ids=[])
        logits = self.model.compute_logits(hidden[x.logits_indices])  # [S, vocab]
        states = [self.states[r] for r in sampling]
        out = self.sampler(logits, states)
        token_ids: list[int] = out.token_ids.tolist()  # the step's one host sync
        for state, token in zip(states, token_ids):
            state.record(token)
        return ModelRunnerOutput(sampled_token_ids=token_ids, logprobs=out.logprobs)

    def shutdown(self) -> None:
        self.kv_caches = []
        self.states.clear()
        if hasattr(self, "model"):
            del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ sizing
    def _decide_num_blocks(self, max_model_len: int) -> int:
        cfg = self.config
        max_useful = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cpu":
            return blocks_for_budget(self.kv_spec, int(cfg.cpu_kv_cache_gib * 2**30), max_useful)
        return blocks_for_budget(self.kv_spec, self._profile_free_cuda_bytes(max_model_len), max_useful)

    @torch.inference_mode()
    def _profile_free_cuda_bytes(self, max_model_len: int) -> int:
        """Run the largest step we may schedule with a throwaway cache, and keep what remains for KV."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, max_model_len)
        blocks = -(-n // self.config.block_size)
        scratch = allocate_kv_cache(self.kv_spec, blocks, self.device)
        from asyncllm.core.scheduler_output import ScheduledSeq

        probe = SchedulerOutput(
            seqs=[
                ScheduledSeq(
                    "profile",
                    torch.randint(0, self.arch.vocab_size, (n,)).tolist(),
                    0,
                    list(range(blocks)),
                    True,
                )
            ]
        )
        saved = self.inputs if hasattr(self, "inputs") else None
        self.inputs = InputBuffers(n, 1, blocks, self.config.block_size, self.device)
        x = self.inputs.prepare(probe)
        self.backend.prepare(x.meta)
        hidden = self.model(x.input_ids, x.positions, scratch, x.meta)
        # The sampler's peak: float32 logits (and a softmax-sized temporary) for a full batch of sequences.
        rows = hidden[: min(self.config.max_num_seqs, n)]
        torch.softmax(self.model.compute_logits(rows).float(), dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden, x
        if saved is not None:
            self.inputs = saved
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_now, _ = torch.cuda.mem_get_info(self.device)
        others = total - free_now - torch.cuda.memory_reserved(self.device)  # other processes on the GPU
        budget = int(total * self.config.gpu_memory_utilization) - peak - max(others, 0)
        return max(budget, 0)


@torch.no_grad()
def _fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Small random weights (never zeros: they hide wrong indexing and run faster than real data)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.9, 1.1, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)
