"""Building a model on its device and filling its weights, from a checkpoint or at random.

Knows which model class serves a checkpoint (through the registry) and how weights reach it; under tensor
parallelism it builds this rank's shard and reads only its slices of the weights. Knows nothing of KV
caches, batching or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import LoadFormat
from asyncllm.layers.parallel import TPGroup, WeightShard
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.dummy import fill_dummy_weights
from asyncllm.model_loader.progress import with_progress
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class
from asyncllm.models.tensor_parallel import shard_arch, shard_model, weight_shard


def load_model(
    checkpoint: Checkpoint,
    arch: ModelArchConfig,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    load_format: LoadFormat,
    seed: int,
    parallel: TPGroup | None = None,
) -> CausalLM:
    """The checkpoint's model in eval mode on `device` in `dtype`, every weight loaded (or random for "dummy").

    With `parallel`, this rank's shard: built at the per-rank size (never the whole model first), its
    communicating layers swapped in, and only its slices of the weights read.
    """
    model_cls = resolve_model_class(checkpoint.hf_config)
    world_size = 1 if parallel is None else parallel.world_size
    with torch.device(device):
        model = model_cls(shard_arch(arch, world_size), backend)
    if parallel is not None:
        shard_model(model, arch, parallel)
    # Cast before loading: weights are copied (and cast) into place, never held twice on the device.
    model = model.to(dtype=dtype).eval()
    if load_format is LoadFormat.DUMMY:
        fill_dummy_weights(model, seed)  # the same draws on every rank: replicated weights agree
    elif parallel is None:
        model.load_weights(with_progress(checkpoint.iter_weights(), checkpoint.num_tensors))
    else:
        rank, plan = parallel.rank, model_cls.family.weights

        def select(name: str) -> WeightShard | None:
            return weight_shard(name, arch, rank, world_size, plan)

        if checkpoint.iter_weight_shards is not None:
            weights = checkpoint.iter_weight_shards(select)
        else:  # e.g. GGUF: tensors are dequantized whole, then sliced
            weights = _sliced(checkpoint, select)
        model.load_weights(with_progress(weights, checkpoint.num_tensors))
    return model


def _sliced(checkpoint: Checkpoint, select: Callable[[str], WeightShard | None]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in checkpoint.iter_weights():
        shard = select(name)
        yield name, tensor if shard is None else shard.take(tensor)
