"""`WorkerTuning`: the tuning variables a worker builds with (`asyncllm.envs`: the decode kernels' switches,
cascade decode, what the CUDA graphs hold, where the grammar matchers live), read once per engine where the
model is resolved and sent to every rank inside `ResolvedModel`, so tensor-parallel ranks build alike
whatever their own environment.
Plain Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.envs import CascadeAttention, CudaGraphCapture, DecodeGemv, DecodeLayerPrefetch, GrammarProcessChoice


@dataclass(frozen=True)
class WorkerTuning:
    decode_gemv: DecodeGemv  # ASYNCLLM_DECODE_GEMV
    decode_pdl: bool  # ASYNCLLM_DECODE_PDL
    decode_fold_reduce: bool  # ASYNCLLM_DECODE_FOLD_REDUCE
    decode_layer: bool  # ASYNCLLM_DECODE_LAYER
    decode_layer_prefetch: DecodeLayerPrefetch  # ASYNCLLM_DECODE_LAYER_PREFETCH
    cascade_attention: CascadeAttention  # ASYNCLLM_CASCADE_ATTENTION
    cuda_graph_sampling: bool  # ASYNCLLM_CUDA_GRAPH_SAMPLING
    cuda_graph_max_tokens: int  # ASYNCLLM_CUDA_GRAPH_MAX_TOKENS, "auto" settled for this engine's step budget
    cuda_graph_capture: CudaGraphCapture  # ASYNCLLM_CUDA_GRAPH_CAPTURE
    grammar_process: GrammarProcessChoice  # ASYNCLLM_GRAMMAR_PROCESS
    grammar_process_threads: int | None  # ASYNCLLM_GRAMMAR_PROCESS_THREADS (None: auto)
    jump_forward: bool  # ASYNCLLM_JUMP_FORWARD
    grammar_slow_fill_s: float | None  # ASYNCLLM_GRAMMAR_SLOW_FILL_MS, in seconds (None: off)

    @classmethod
    def read(cls, config: EngineConfig) -> WorkerTuning:
        """The variables now (a bad value raises `InvalidConfigError` naming it)."""
        return cls(
            decode_gemv=envs.DECODE_GEMV.get(),
            decode_pdl=envs.DECODE_PDL.get(),
            decode_fold_reduce=envs.DECODE_FOLD_REDUCE.get(),
            decode_layer=envs.DECODE_LAYER.get(),
            decode_layer_prefetch=envs.DECODE_LAYER_PREFETCH.get(),
            cascade_attention=envs.CASCADE_ATTENTION.get(),
            cuda_graph_sampling=envs.CUDA_GRAPH_SAMPLING.get(),
            cuda_graph_max_tokens=config.graph_max_tokens(envs.CUDA_GRAPH_MAX_TOKENS.get()),
            cuda_graph_capture=envs.CUDA_GRAPH_CAPTURE.get(),
            grammar_process=envs.GRAMMAR_PROCESS.get(),
            grammar_process_threads=envs.GRAMMAR_PROCESS_THREADS.get(),
            jump_forward=envs.JUMP_FORWARD.get(),
            grammar_slow_fill_s=envs.grammar_slow_fill_s(),
        )
