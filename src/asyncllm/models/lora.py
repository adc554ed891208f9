"""LoRA applied from outside the model files, generic over a family's `WeightPlan`: which linear layers take
adapters, where an adapter's weights sit in the slot pool, wrapping those layers (`LoRALinear`), and packing
one adapter's tensors (sharded like their base layers under tensor parallelism) into a pool row.

Every linear the plan names takes adapters: its packed layers (q/k/v, gate/up: each checkpoint module's A and
B go to its own shard), its column- and row-parallel ones. Embeddings and the LM head do not. The pool holds
one adapter per slot as one contiguous row (per layer: A [S * R, in], then B [out, R], R the padded rank), so
loading an adapter into a slot is one copy. Knows no file format (adapters arrive as tensors under their
checkpoint module names) and no process group (rank and world size are numbers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from asyncllm.errors import LoRAError
from asyncllm.layers.linear import Linear, PackedLinear
from asyncllm.layers.lora import LoRABatch, LoRALinear
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.tensor_parallel import split_size, weight_shard

AdapterTensors = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # checkpoint module -> (A [r, in], B [out, r])


def padded_rank(max_lora_rank: int) -> int:
    """The rank every slot holds: a power of two, at least 16 (the kernels' smallest dot tile)."""
    return max(16, 1 << (max_lora_rank - 1).bit_length())


@dataclass(frozen=True)
class LoRATarget:
    """One linear layer that takes adapters, at this rank's size."""

    path: str  # our module's path, e.g. model.layers.0.self_attn.qkv_proj
    names: tuple[str, ...]  # the checkpoint modules it packs, in output order: (q_proj, k_proj, v_proj)
    shard_sizes: tuple[int, ...]  # this rank's output rows of each
    in_features: int  # this rank's input columns
    a_offset: int  # where its A [S * R, in] starts in a pool row
    b_offset: int  # where its B [out, R] starts


class LoRALayout:
    """The targets of a model and where each sits in a pool row of rank `rank` (already padded)."""

    def __init__(self, model: CausalLM, rank: int) -> None:
        self.rank = rank
        plan = model.family.weights
        packed_names = {ours_and_shard: hf for hf, ours_and_shard in plan.packed.items()}
        self.targets: list[LoRATarget] = []
        offset = 0
        for path, module in model.named_modules():
            attr = path.rpartition(".")[2]
            if isinstance(module, PackedLinear):
                names = tuple(packed_names.get((attr, shard), "") for shard in module.shard_sizes)
                if "" in names:
                    continue
                sizes = tuple(module.shard_sizes.values())
            elif isinstance(module, Linear) and (attr in plan.column_parallel or attr in plan.row_parallel):
                names, sizes = (attr,), (module.weight.shape[0],)
            else:
                continue
            in_features = module.weight.shape[1]
            a_offset = offset
            offset += len(names) * rank * in_features
            self.targets.append(LoRATarget(path, names, sizes, in_features, a_offset, offset))
            offset += sum(sizes) * rank
        self.numel = offset
        parents = {t.path: t.path.rpartition(".")[0] for t in self.targets}
        self._by_module = {
            f"{parents[t.path]}.{name}" if parents[t.path] else name: (t, i)
            for t in self.targets
            for i, name in enumerate(t.names)
        }

    def locate(self, module: str) -> tuple[LoRATarget, int] | None:
        """The target and shard holding checkpoint module `module` (e.g. model.layers.0.self_attn.q_proj)."""
        return self._by_module.get(module)

    def a_view(self, pool: torch.Tensor, target: LoRATarget) -> torch.Tensor:
        """[rows, S * R, in] of `pool` [rows, numel] (a pool, or one adapter's row as [1, numel])."""
        n = len(target.names) * self.rank * target.in_features
        return pool[:, target.a_offset : target.a_offset + n].view(pool.shape[0], -1, target.in_features)

    def b_view(self, pool: torch.Tensor, target: LoRATarget) -> torch.Tensor:
        """[rows, out, R] of `pool` [rows, numel]."""
        n = sum(target.shard_sizes) * self.rank
        return pool[:, target.b_offset : target.b_offset + n].view(pool.shape[0], -1, self.rank)


def attach_lora(model: CausalLM, layout: LoRALayout, pool: torch.Tensor, batch: LoRABatch) -> None:
    """Wrap every target of `layout` in a `LoRALinear` reading its slots of `pool` [slots, numel], in place."""
    for target in layout.targets:
        parent_name, _, attr = target.path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, attr)
        assert isinstance(base, Linear), target.path
        a, b = layout.a_view(pool, target), layout.b_view(pool, target)
        setattr(parent, attr, LoRALinear(base, a, b, target.shard_sizes, batch))


def pack_adapter(
    layout: LoRALayout,
    tensors: AdapterTensors,
    scaling: float,
    arch: ModelArchConfig,
    model: nn.Module,
    rank: int = 0,
    world_size: int = 1,
) -> torch.Tensor:
    """One pool row [numel] (float32, on the CPU) holding an adapter: each module's A in its shard's rank rows,
    B * scaling in its output rows, this rank's slices of both (a column-parallel layer's B rows, a
    row-parallel layer's A columns), zeros elsewhere. Raises `LoRAError` naming what does not fit."""
    assert isinstance(model, CausalLM)
    plan = model.family.weights
    unknown = sorted({re.sub(r"\.\d+\.", ".*.", name) for name in tensors if layout.locate(name) is None})
    if unknown:
        raise LoRAError(
            f"the adapter targets modules asyncllm cannot apply LoRA to: {', '.join(unknown[:6])}"
            + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
            + "; supported target modules: "
            + ", ".join(sorted({n for t in layout.targets for n in t.names}))
        )
    row = torch.zeros(1, layout.numel, dtype=torch.float32)
    for name, (a, b) in tensors.items():
        found = layout.locate(name)
        assert found is not None
        target, shard = found
        attr = name.rpartition(".")[2]
        r = a.shape[0]
        col_split, row_split = plan.column_parallel.get(attr), plan.row_parallel.get(attr)
        out_full = split_size(col_split, arch) if col_split is not None else target.shard_sizes[shard]
        in_full = split_size(row_split, arch) if row_split is not None else target.in_features
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_full) or tuple(b.shape) != (out_full, r):
            raise LoRAError(
                f"the adapter's {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model "
                f"needs [r, {in_full}] and [{out_full}, r]: the adapter was trained for another model"
            )
        cut = weight_shard(f"{name}.weight", arch, rank, world_size, plan)
        if cut is not None:  # this rank's slice: the base weight's rows (B's) or columns (A's)
            b, a = (cut.take(b), a) if cut.dim == 0 else (b, cut.take(a))
        a_rows = layout.a_view(row, target)[0]  # [S * R, in]
        a_rows[shard * layout.rank : shard * layout.rank + r] = a.float()
        first = sum(target.shard_sizes[:shard])
        b_rows = layout.b_view(row, target)[0]  # [out, R]
        b_rows[first : first + target.shard_sizes[shard], :r] = b.float() * scaling
    return row[0]
