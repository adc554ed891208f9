"""Building a model on its device and filling its weights, from a checkpoint or at random.

Knows which model class serves a checkpoint (through the registry) and how weights reach it; under tensor
parallelism it builds this rank's shard and reads only its slices of the weights; with a quantization scheme
it swaps the linear layers for quantized ones and converts the checkpoint's tensors to their layout (the
`quantization` package). A checkpoint's KV-cache scales go to the attention layers (kv_scales.py). Knows
nothing of KV caches, batching or the engine.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch

from asyncllm import envs
from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import LoadFormat
from asyncllm.errors import UnsupportedModelError
from asyncllm.layers import host_heap
from asyncllm.layers.parallel import TPGroup, WeightShard
from asyncllm.layers.param_dtype import parameters_in
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.dummy import fill_dummy_weights
from asyncllm.model_loader.kv_scales import KVScales, kv_scale_name
from asyncllm.model_loader.progress import with_progress
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_architecture
from asyncllm.models.tensor_parallel import shard_arch, shard_model, weight_shard
from asyncllm.quantization.apply import quantize_linear_layers
from asyncllm.quantization.convert import CheckpointConverter
from asyncllm.quantization.scheme import CheckpointFormat, QuantScheme
from asyncllm.quantization.sharding import quantized_shards

if TYPE_CHECKING:
    from asyncllm.kernels.cpu_decode_native import CpuDecodeOps

logger = logging.getLogger("asyncllm")

Weights = Iterator[tuple[str, torch.Tensor]]


def load_model(
    checkpoint: Checkpoint,
    arch: ModelArchConfig,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    load_format: LoadFormat,
    seed: int,
    parallel: TPGroup | None = None,
    quant: QuantScheme | None = None,
) -> CausalLM:
    """The checkpoint's model in eval mode on `device` in `dtype`, every weight loaded (or random for "dummy").

    With `parallel`, this rank's shard: built at the per-rank size (never the whole model first), its
    communicating layers swapped in, and only its slices of the weights read. With `quant`, its linear layers
    quantized (swapped after sharding; the checkpoint's tensors converted to their layout as they are read).
    """
    model_cls = resolve_architecture(arch.architecture).model_class  # a worker rank's checkpoint has no hf_config
    if not issubclass(model_cls, CausalLM):
        raise UnsupportedModelError(
            f"{arch.architecture} is an encoder: it serves embeddings and scores, not generation "
            "(model_loader/encoder.py builds it)"
        )
    world_size = 1 if parallel is None else parallel.world_size
    if device.type == "cpu":
        host_heap.for_load()  # the load's copies leave nothing resident once freed
    # Parameters are allocated in `dtype` (never the whole model in float32 first); buffers computed at
    # construction are cast once below. Weights are then copied (and cast) into place, never held twice.
    with torch.device(device), parameters_in(dtype):
        model = model_cls(shard_arch(arch, world_size), backend)
        if parallel is not None:
            shard_model(model, arch, parallel)
    model = model.to(dtype=dtype).eval()
    plan = model_cls.family.weights
    quantized: dict[str, QuantScheme] = {}  # the checkpoint modules whose layers are quantized, with their schemes
    if quant is not None:
        quantized = quantize_linear_layers(model, quant, plan.packed)
        logger.info("quantized linear layers: %s", quant.describe())
    if load_format is LoadFormat.DUMMY:
        fill_dummy_weights(model, seed)  # the same draws on every rank: replicated weights agree
        return _on_cpu_kernel(model, quant, device, dtype)
    rank = 0 if parallel is None else parallel.rank
    kv_scales = KVScales()  # taken out of the stream before anything converts or slices it

    def select(name: str) -> WeightShard | None:
        return None if kv_scale_name(name) is not None else weight_shard(name, arch, rank, world_size, plan)

    def whole() -> Weights:
        if quant is not None and quant.checkpoint is CheckpointFormat.GGUF:  # repacked by the GGUF reader itself
            assert checkpoint.iter_quantized_weights is not None
            return with_progress(checkpoint.iter_quantized_weights(quantized), checkpoint.num_tensors)
        weights = kv_scales.take(with_progress(checkpoint.iter_weights(), checkpoint.num_tensors))
        return weights if quant is None else CheckpointConverter(quant, quantized, device).convert(weights)

    if parallel is None:
        model.load_weights(whole())
    elif quant is not None:  # converted whole, then sliced in the layout's units
        model.load_weights(_sliced(whole(), quantized_shards(select, quantized)))
    elif checkpoint.iter_weight_shards is not None:
        shards = with_progress(checkpoint.iter_weight_shards(select), checkpoint.num_tensors)
        model.load_weights(kv_scales.take(shards))
    else:  # e.g. GGUF: tensors are dequantized whole, then sliced
        model.load_weights(_sliced(whole(), select))
    if kv_scales.apply(model):
        logger.info(
            "KV-cache scales read for %d attention layers (kv_cache_dtype='fp8' uses them)", len(kv_scales.found)
        )
    return _on_cpu_kernel(model, quant, device, dtype)


def _on_cpu_kernel(model: CausalLM, quant: QuantScheme | None, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """With `quant.cpu_int4` on a CPU, the loaded layers (and head) switched to torch's int4 kernel; on a CPU,
    the decode path of few ops installed where it reproduces every layer (ASYNCLLM_CPU_DECODE)."""
    if quant is not None and quant.cpu_int4 and device.type == "cpu":
        from asyncllm.quantization.cpu_pack import use_cpu_int4

        use_cpu_int4(model, quant, dtype)
    native = functools.cache(partial(_native_ops, quant))  # built (once per machine) only for a model it fits
    if device.type == "cpu":
        from asyncllm.quantization.cpu_q8_head import use_q8_head

        if use_q8_head(model, native):
            logger.info("the LM head reads the embedding's 8-bit codes in C (ASYNCLLM_CPU_NATIVE=off: packed int4)")
    if device.type == "cpu" and envs.CPU_DECODE.get() is envs.CpuDecode.AUTO:
        from asyncllm.models import cpu_decode

        decode = cpu_decode.build(model, native)
        if decode is not None:
            model.cpu_decode = decode  # type: ignore[assignment]
            logger.info(
                "CPU decode steps take models/cpu_decode.py%s (ASYNCLLM_CPU_DECODE=off: the modules)",
                ", small ops in C" if decode.native is not None else "",
            )
    if device.type == "cpu":
        host_heap.for_serving()
    return model


def _native_ops(quant: QuantScheme | None) -> CpuDecodeOps | None:
    """The CPU decode path's compiled small ops, for packed int4 layers only (built once per machine)."""
    if quant is None or not quant.cpu_int4 or envs.CPU_NATIVE.get() is envs.CpuNative.OFF:
        return None
    from asyncllm.kernels import cpu_decode_native

    return cpu_decode_native.load(envs.cache_home() / "cpu-kernels")


def _sliced(weights: Weights, select: Callable[[str], WeightShard | None]) -> Weights:
    for name, tensor in weights:
        shard = select(name)
        yield name, tensor if shard is None else shard.take(tensor)
