"""Tensor parallelism applied from outside the model files, generic over a family's `WeightPlan`.

All pure functions of the architecture, the plan, the rank and the world size: `check_tensor_parallel` (which
sizes divide), `shard_arch` (the per-rank shape a model is built at: its query heads, KV heads, MLP slice and
vocabulary rows), `shard_model` (swaps the plan's row-parallel layers, MoE layers, embedding and
head for their communicating forms) and `weight_shard` (the slice of each checkpoint tensor a rank loads). KV heads are
split across ranks, or replicated when there are fewer KV heads than ranks. Knows no family's module names
and no process group beyond `TPGroup`.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from asyncllm.errors import InvalidConfigError
from asyncllm.layers.embedding import LMHead, VocabEmbedding
from asyncllm.layers.linear import Linear
from asyncllm.layers.moe import ParallelSparseMoE, SparseMoE
from asyncllm.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    WeightShard,
    shard_range,
)
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.family import Split, WeightPlan
from asyncllm.models.registry import resolve_architecture


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
    if arch.moe is not None and arch.moe.intermediate_size % world_size:
        raise InvalidConfigError(
            f"tensor_parallel_size={world_size} does not divide the model's moe_intermediate_size="
            f"{arch.moe.intermediate_size}: {fix}"
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
        moe=None
        if arch.moe is None
        else dataclasses.replace(arch.moe, intermediate_size=arch.moe.intermediate_size // world_size),
    )


def shard_model(model: nn.Module, arch: ModelArchConfig, group: TPGroup) -> None:
    """Give a model built at `shard_arch` size its communicating layers, in place. Column-parallel layers
    (packed or not) are already right: built at the local size, they compute this rank's rows."""
    assert isinstance(model, CausalLM), type(model)
    plan = model.family.weights
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        if attr in plan.row_parallel and isinstance(module, Linear):
            setattr(model.get_submodule(parent_name), attr, RowParallelLinear(module, group))
        elif isinstance(module, SparseMoE):  # its experts' down projections are row-parallel: one all-reduce
            setattr(model.get_submodule(parent_name), attr, ParallelSparseMoE(module, group))
    parent, attr = _parent(model, plan.embedding)
    embed = getattr(parent, attr)
    assert isinstance(embed, VocabEmbedding), plan.embedding
    setattr(parent, attr, VocabParallelEmbedding(embed, group))
    parent, attr = _parent(model, plan.lm_head)
    head = getattr(parent, attr)
    if isinstance(head, LMHead):
        setattr(parent, attr, ParallelLMHead.from_head(head, arch.vocab_size, group))
    else:  # tied: the head is the embedding's shard, all-gathered the same way
        assert head is None, (plan.lm_head, type(head))
        setattr(parent, attr, ParallelLMHead(embed.weight, arch.vocab_size, group))


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    """(the module holding `path`'s last component, that component's name)."""
    parent_name, _, attr = path.rpartition(".")
    return model.get_submodule(parent_name), attr


def weight_shard(
    name: str, arch: ModelArchConfig, rank: int, world_size: int, plan: WeightPlan | None = None
) -> WeightShard | None:
    """The slice of checkpoint tensor `name` that `rank` loads; None: all of it. `plan`: the family's weight
    plan, by default that of `arch.architecture` in the registry."""
    if world_size == 1:
        return None
    if plan is None:
        plan = resolve_architecture(arch.architecture).model_class.family.weights
    module_path, _, param = name.rpartition(".")
    module = module_path.rpartition(".")[2]
    if plan.experts is not None and (projection := plan.experts.projection(module_path)) is not None:
        return _expert_shard(projection, param, plan, arch, rank, world_size)
    if module_path in (plan.embedding, plan.lm_head):
        rows = local_vocab_size(arch.vocab_size, world_size)
        start = min(rank * rows, arch.vocab_size)
        return WeightShard(0, start, min(start + rows, arch.vocab_size), rows)
    if module in plan.column_parallel:  # output rows, bias alike
        start, stop = _split_range(plan.column_parallel[module], arch, rank, world_size)
        return WeightShard(0, start, stop, stop - start)
    if module in plan.row_parallel and param == "weight":  # the bias is whole, added once after the all-reduce
        start, stop = _split_range(plan.row_parallel[module], arch, rank, world_size)
        return WeightShard(1, start, stop, stop - start)
    return None  # norms: replicated


def _expert_shard(
    projection: tuple[str, bool], param: str, plan: WeightPlan, arch: ModelArchConfig, rank: int, world_size: int
) -> WeightShard | None:
    """An expert's projection (one expert's [out, in], or every expert's stacked [E, out, in]) cut as the
    plan's experts say."""
    assert plan.experts is not None
    module, stacked = projection
    if module in plan.experts.column_parallel:
        dim, split = 0, plan.experts.column_parallel[module]
    elif module in plan.experts.row_parallel and param == "weight":
        dim, split = 1, plan.experts.row_parallel[module]
    else:
        return None
    start, stop = _split_range(split, arch, rank, world_size)
    return WeightShard(dim + (1 if stacked else 0), start, stop, stop - start)


def split_size(split: Split, arch: ModelArchConfig) -> int:
    """The whole (unsharded) size of the dimension `split` cuts, in rows or columns."""
    if split is Split.QUERY_HEADS:
        return arch.num_heads * arch.head_dim
    if split is Split.KV_HEADS:
        return arch.num_kv_heads * arch.head_dim
    assert split is Split.INTERMEDIATE, split
    return arch.intermediate_size


def _split_range(split: Split, arch: ModelArchConfig, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s rows (or columns) of a tensor cut along `split`."""
    d = arch.head_dim
    if split is Split.QUERY_HEADS:
        start, stop = shard_range(arch.num_heads, rank, world_size)
        return start * d, stop * d
    if split is Split.KV_HEADS:
        start, stop = kv_head_range(arch.num_kv_heads, rank, world_size)
        return start * d, stop * d
    if split is Split.EXPERT_INTERMEDIATE:
        assert arch.moe is not None, "an experts split needs a MoE config"
        return shard_range(arch.moe.intermediate_size, rank, world_size)
    assert split is Split.INTERMEDIATE, split
    return shard_range(arch.intermediate_size, rank, world_size)


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """The KV heads `rank` holds: its share when they divide, else the one its query heads attend to."""
    if num_kv_heads >= world_size:
        return shard_range(num_kv_heads, rank, world_size)
    head = rank * num_kv_heads // world_size  # world_size / num_kv_heads consecutive ranks share a head
    return head, head + 1
