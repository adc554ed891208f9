"""Tensor parallelism for the Llama family (Llama, Mistral, Qwen2, Qwen3), applied from outside the model files.

All pure functions of the architecture, the rank and the world size: `check_tensor_parallel` (which sizes
divide), `shard_arch` (the per-rank shape a model is built at: its query heads, KV heads, MLP slice and
vocabulary rows), `shard_model` (swaps the built layers that must communicate for their parallel forms) and
`weight_shard` (the slice of each checkpoint tensor a rank loads). KV heads are split across ranks, or
replicated when there are fewer KV heads than ranks. Knows no process group beyond `TPGroup`.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from asyncllm.errors import InvalidConfigError
from asyncllm.layers.embedding import LMHead, VocabEmbedding
from asyncllm.layers.linear import Linear
from asyncllm.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    WeightShard,
    shard_range,
)
from asyncllm.models.config import ModelArchConfig

_ROW_PARALLEL = ("o_proj", "down_proj")  # their input is split: partial sums, all-reduced


def check_tensor_parallel(arch: ModelArchConfig, world_size: int) -> None:
    """InvalidConfigError unless `arch` splits evenly over `world_size` ranks."""
    fix = "choose a tensor_parallel_size that divides them"
    if arch.num_heads % world_size:
        raise InvalidConfigError(
            f"tensor_parallel_size={world_size} does not divide the model's {arch.num_heads} attention heads: {fix}"
        )
    kv = arch.num_kv_heads
    if kv % world_size and world_size % kv:
        raise InvalidConfigError(
            f"tensor_parallel_size={world_size} neither divides the model's {kv} KV heads nor is a multiple of "
            f"them (then each KV head is replicated): {fix}"
        )
    if arch.intermediate_size % world_size:
        raise InvalidConfigError(
            f"tensor_parallel_size={world_size} does not divide the model's intermediate_size="
            f"{arch.intermediate_size}: {fix}"
        )


def local_vocab_size(vocab_size: int, world_size: int) -> int:
    """Rows of the embedding and LM head per rank (the last rank's are zero-padded when they do not divide)."""
    return -(-vocab_size // world_size)


def shard_arch(arch: ModelArchConfig, world_size: int) -> ModelArchConfig:
    """The shape one rank's model is built at: every split dimension divided by `world_size`."""
    check_tensor_parallel(arch, world_size)
    if world_size == 1:
        return arch
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // world_size,
        num_kv_heads=max(1, arch.num_kv_heads // world_size),
        intermediate_size=arch.intermediate_size // world_size,
        vocab_size=local_vocab_size(arch.vocab_size, world_size),
    )


def shard_model(model: nn.Module, arch: ModelArchConfig, group: TPGroup) -> None:
    """Give a model built at `shard_arch` size its communicating layers, in place. Column-parallel layers
    (qkv_proj, gate_up_proj) are already right: built at the local size, they compute this rank's rows."""
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        if attr in _ROW_PARALLEL and isinstance(module, Linear):
            setattr(model.get_submodule(parent_name), attr, RowParallelLinear(module, group))
        elif attr == "embed_tokens" and isinstance(module, VocabEmbedding):
            setattr(model.get_submodule(parent_name), attr, VocabParallelEmbedding(module, group))
    head = getattr(model, "lm_head", None)
    if isinstance(head, LMHead):
        model.lm_head = ParallelLMHead.from_head(head, arch.vocab_size, group)
    elif head is None:  # tied: the head is the embedding's shard, all-gathered the same way
        embed = model.get_submodule("model.embed_tokens")
        assert isinstance(embed, VocabEmbedding)
        model.lm_head = ParallelLMHead(embed.weight, arch.vocab_size, group)


def weight_shard(name: str, arch: ModelArchConfig, rank: int, world_size: int) -> WeightShard | None:
    """The slice of checkpoint tensor `name` (a Hugging Face name) that `rank` loads; None: all of it."""
    if world_size == 1:
        return None
    parts = name.split(".")
    module, param = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    d = arch.head_dim
    if module in ("embed_tokens", "lm_head"):
        rows = local_vocab_size(arch.vocab_size, world_size)
        start = min(rank * rows, arch.vocab_size)
        return WeightShard(0, start, min(start + rows, arch.vocab_size), rows)
    if module == "q_proj":
        start, stop = shard_range(arch.num_heads, rank, world_size)
        return WeightShard(0, start * d, stop * d, (stop - start) * d)
    if module in ("k_proj", "v_proj"):
        start, stop = kv_head_range(arch.num_kv_heads, rank, world_size)
        return WeightShard(0, start * d, stop * d, (stop - start) * d)
    if module in ("gate_proj", "up_proj"):
        start, stop = shard_range(arch.intermediate_size, rank, world_size)
        return WeightShard(0, start, stop, stop - start)
    if module in _ROW_PARALLEL and param == "weight":  # the bias is whole, added once after the all-reduce
        size = arch.num_heads * d if module == "o_proj" else arch.intermediate_size
        start, stop = shard_range(size, rank, world_size)
        return WeightShard(1, start, stop, stop - start)
    return None  # norms: replicated


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """The KV heads `rank` holds: its share when they divide, else the one its query heads attend to."""
    if num_kv_heads >= world_size:
        return shard_range(num_kv_heads, rank, world_size)
    head = rank * num_kv_heads // world_size  # world_size / num_kv_heads consecutive ranks share a head
    return head, head + 1
