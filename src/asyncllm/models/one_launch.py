"""A decoder layer's small decode steps in one persistent launch (kernels/decode_layer.py), switched on from
outside like the other fused forms (ASYNCLLM_DECODE_LAYER). A layer opts in by deriving from `OneLaunchLayer`:
it names its weights where its maths is the kernel's, and takes a `OneLaunchDecoder`, which decides per step
whether the step is one the kernel runs (decode-only, at most `max_rows` rows, a cache in the activations'
dtype) and otherwise returns None, so the layer runs its own chain. Knows nothing of which model uses it.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.layer import KVCache
from asyncllm.kernels.decode_layer_plan import (
    BULK_PREFETCH,
    MAX_ROWS,
    DecodeLayerConfig,
    DecodeLayerScratch,
    layout_of,
    plan_config,
)
from asyncllm.kernels.decode_layer_ref import DecodeLayerWeights
from asyncllm.layers.rotary import RotaryInputs


@dataclass(frozen=True)
class OneLaunchSpec:
    """What the kernel needs of a layer besides the step: its weights and the softmax scale."""

    weights: DecodeLayerWeights
    scale: float


class OneLaunchLayer(ABC):
    """A decoder layer the persistent decode kernel can run whole."""

    @abstractmethod
    def one_launch_spec(self) -> OneLaunchSpec | None:
        """This layer's weights and scale, or None where its maths or weights are not the kernel's (LoRA,
        quantized or row-parallel projections, biases, another norm, a sliding window, a transposed weight)."""

    @abstractmethod
    def use_one_launch(self, decoder: OneLaunchDecoder | None) -> None:
        """Run small decode steps through `decoder` (None: never)."""


class OneLaunchDecoder:
    """One layer's persistent launch, for the steps it takes; the scratch is shared by the layers of a model
    (they run one after another on one stream)."""

    def __init__(
        self, spec: OneLaunchSpec, scratch: DecodeLayerScratch, programs: int, configs: dict[int, DecodeLayerConfig]
    ) -> None:
        from asyncllm.kernels import decode_layer  # imports triton: only once a layer is switched on

        self._kernel = decode_layer
        self.spec = spec
        self.scratch = scratch
        self.programs = programs
        self._configs = configs  # each row count's tiles, planned once (a launch would plan them on the host)
        self.next_qkv: torch.Tensor | None = None  # the next layer's qkv weight, asked for during this one's MLP

    def prefetch_ahead(self) -> bool:
        return all(config.prefetch == "ahead" for config in self._configs.values())

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the layer's output, the residual stream before it), or None where the step is not one it takes:
        more rows than the scratch holds, a row of more than one query token (prefill, a draft's verify) or of
        no sequence (a mixed graph's padding), or an FP8 cache. Host-side tests only: a CUDA graph's capture
        decides for every replay of its bucket, and a decode bucket replays decode-only steps alone."""
        rows = x.shape[0]
        k_cache, v_cache = kv_cache
        if rows > self.scratch.max_rows or meta.max_query_len != 1 or len(meta.seq_lens_cpu) != rows:
            return None
        if k_cache.dtype != x.dtype:
            return None
        return self._kernel.decode_layer(  # type: ignore[no-any-return]
            x, residual, self.spec.weights, k_cache, v_cache, rope.positions, rope.cos_cache, rope.sin_cache,
            meta.slot_mapping, meta.block_tables, meta.seq_lens[:rows], self.spec.scale, self.scratch,
            programs=self.programs, config=self._configs[rows], next_qkv=self.next_qkv,
        )  # fmt: skip


# The most rows the engine sends to the kernel (which takes up to MAX_ROWS): one. Its several-row form lost
# to cuBLAS in every measured shape (Qwen3-8B at 4 rows 384 against 164 us a layer; bench/RESULTS.md,
# 2026-12-07); the kernel's tests cover 1-16 rows for when a faster form is measured.
ENGINE_MAX_ROWS = 1


def use_one_launch_layers(model: nn.Module, device: torch.device, max_num_seqs: int, prefetch: str = "auto") -> int:
    """Switch every `OneLaunchLayer` of `model` whose spec the kernel takes to its one launch for steps of up to
    min(max_num_seqs, ENGINE_MAX_ROWS) rows; returns how many did. Layers of one shape share one scratch.
    `prefetch` (ASYNCLLM_DECODE_LAYER_PREFETCH): how each launch asks L2 for its weights (`_configs`); with
    "ahead" a launch also asks for the next layer's qkv where that layer runs the same launch."""
    max_rows = min(max_num_seqs, ENGINE_MAX_ROWS, MAX_ROWS)
    programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    scratches: dict[tuple[object, ...], DecodeLayerScratch] = {}
    decoders: list[OneLaunchDecoder | None] = []  # in the layers' order: None where one runs its chain
    for module in model.modules():
        if not isinstance(module, OneLaunchLayer):
            continue
        spec = module.one_launch_spec()
        configs = None if spec is None else _configs(spec.weights, max_rows, programs, prefetch)
        if spec is None or configs is None:
            module.use_one_launch(None)
            decoders.append(None)
            continue
        key = layout_of(spec.weights)
        if key not in scratches:
            scratches[key] = DecodeLayerScratch(spec.weights, max_rows, device)
        decoders.append(OneLaunchDecoder(spec, scratches[key], programs, configs))
        module.use_one_launch(decoders[-1])
    for decoder, after in itertools.pairwise(decoders):
        # A layer prefetching ahead asks for the next one's qkv tiles too, where the next runs the same launch.
        if (
            decoder is not None
            and after is not None
            and decoder.prefetch_ahead()
            and (layout_of(after.spec.weights) == layout_of(decoder.spec.weights))
        ):
            decoder.next_qkv = after.spec.weights.qkv
    return sum(d is not None for d in decoders)


def _configs(w: DecodeLayerWeights, max_rows: int, programs: int, prefetch: str) -> dict[int, DecodeLayerConfig] | None:
    """The tiles of every row count up to `max_rows`, with `prefetch` (a PREFETCH_MODES name, or "auto": "off",
    measured fastest: bench/RESULTS.md, 2026-12-08); the copy engine's modes fall back to "off" for a weight
    off a 16-byte boundary (it takes aligned ranges). None where the kernel's tiles do not fit the layer."""
    weights = (w.qkv, w.o, w.gate_up, w.down)
    if prefetch == "auto":
        # On an H100 (Qwen3-0.6B, graphed) every mode lost to none: lines 43.4, ahead 44.6 against 40.3 us a layer.
        prefetch = "off"
    if prefetch in BULK_PREFETCH and any(t.data_ptr() % 16 for t in weights):
        prefetch = "off"
    try:
        return {rows: plan_config(w, rows, programs, prefetch=prefetch) for rows in range(1, max_rows + 1)}
    except ValueError:
        return None
