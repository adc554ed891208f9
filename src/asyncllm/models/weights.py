"""Loading checkpoint-named tensors into a model whose projections may be packed (q/k/v, gate/up) or stacked
over experts (a MoE layer's).

Owns the name mapping a family's `WeightPlan` declares and the bookkeeping that makes loading strict: an
unknown name, a wrong shape, a duplicate or a parameter never received is an error, never a silently random
weight. Knows no family's names and nothing about file formats; weights arrive as (name, tensor) pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from asyncllm.errors import UnsupportedModelError
from asyncllm.layers.linear import Packed
from asyncllm.layers.moe import ExpertLinear
from asyncllm.models.family import WeightPlan

# checkpoint module name -> (packed module name, shard)
PackedNames = Mapping[str, tuple[str, str]]

# (our parameter name, shard or None for an unpacked parameter, expert or None outside an expert stack)
_Slot = tuple[str, str | None, int | None]


def load_planned_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], plan: WeightPlan, tied: bool
) -> None:
    """`load_packed_weights` with the plan's packing and experts; drops the plan's ignored extras and, when the
    head is tied to the embedding, a checkpoint's copy of the head."""
    head = f"{plan.lm_head}.weight"

    def skip(name: str) -> bool:
        return name.endswith(plan.ignored_suffixes) or (tied and name == head)

    load_packed_weights(model, weights, plan.packed, skip, None if plan.experts is None else plan.experts.module)


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: PackedNames,
    skip: Callable[[str], bool],
    experts: str | None = None,
) -> None:
    """Copy every checkpoint tensor into its (shard of a) parameter; `skip(name)` drops known extras.
    `experts`: the module name of a layer's expert list, whose per-expert tensors (`experts.3.up_proj.weight`)
    and stacked ones (`experts.up_proj.weight`, [E, ...]) load into our `ExpertLinear` stacks."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    unpacked = {ours_and_shard: hf for hf, ours_and_shard in packed.items()}
    loaded: set[_Slot] = set()
    for hf_name, tensor in weights:
        if skip(hf_name):
            continue
        name, shard, expert = _to_slot(hf_name, packed, experts)
        module_name, _, attr = name.rpartition(".")
        layer = modules.get(module_name)
        if name not in params or (expert is not None and not isinstance(layer, ExpertLinear)):
            raise UnsupportedModelError(
                f"checkpoint weight {hf_name!r} has no place in {type(model).__name__}: the checkpoint does "
                "not match its config.json architecture, or uses a variant asyncllm does not support"
            )
        if isinstance(layer, ExpertLinear):
            if expert is not None and expert >= layer.num_experts:
                raise UnsupportedModelError(
                    f"checkpoint weight {hf_name!r} belongs to expert {expert}, but the config has "
                    f"{layer.num_experts} experts: the config and the weights disagree"
                )
            experts_filled = range(layer.num_experts) if expert is None else (expert,)
            slots: set[_Slot] = {(name, shard, e) for e in experts_filled}
        else:
            slots = {(name, shard, None)}
        if slots & loaded:
            raise UnsupportedModelError(f"checkpoint weight {hf_name!r} appears twice")
        if isinstance(layer, ExpertLinear):
            layer.load_shard(attr, shard, tensor, expert)
        elif shard is None:
            _copy(params[name], tensor, hf_name)
        else:
            assert isinstance(layer, Packed), module_name
            layer.load_shard(attr, shard, tensor)
        loaded |= slots
    missing = sorted(_hf_name(s, unpacked) for s in _expected_slots(params, modules) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UnsupportedModelError(
            f"checkpoint is missing {len(missing)} weight(s) of {type(model).__name__}: {shown}"
        )


def _to_slot(hf_name: str, packed: PackedNames, experts: str | None) -> _Slot:
    parts = hf_name.split(".")
    expert = None
    if experts is not None and len(parts) >= 4 and parts[-4] == experts and parts[-3].isdigit():
        expert = int(parts.pop(-3))  # one expert's tensor: its place is that expert's row of our stack
    if len(parts) >= 2 and parts[-2] in packed:
        ours, shard = packed[parts[-2]]
        return ".".join([*parts[:-2], ours, parts[-1]]), shard, expert
    return ".".join(parts), None, expert


def _hf_name(slot: _Slot, unpacked: dict[tuple[str, str], str]) -> str:
    """Our slot back to the checkpoint name it should have come from (for error messages)."""
    name, shard, expert = slot
    if shard is None and expert is None:
        return name
    prefix, module, attr = name.rsplit(".", 2)
    if shard is not None:
        module = unpacked[(module, shard)]
    return f"{prefix}.{module}.{attr}" if expert is None else f"{prefix}.{expert}.{module}.{attr}"


def _expected_slots(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> set[_Slot]:
    slots: set[_Slot] = set()
    for name in params:
        module_name, _, _ = name.rpartition(".")
        layer = modules[module_name]
        if isinstance(layer, Packed):
            slots.update((name, shard, None) for shard in layer.shard_sizes)
        elif isinstance(layer, ExpertLinear):
            slots.update((name, shard, e) for shard in layer.shard_sizes for e in range(layer.num_experts))
        else:
            slots.add((name, None, None))
    return slots


def _copy(param: nn.Parameter, tensor: torch.Tensor, hf_name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise UnsupportedModelError(
            f"checkpoint weight {hf_name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(param.shape)}: the config and the weights disagree"
        )
    if _adoptable(param, tensor):
        param.data = tensor  # the loader's own copy taken as it is: a second table would add to the load's peak
        return
    with torch.no_grad():
        param.copy_(tensor)


def _adoptable(param: nn.Parameter, tensor: torch.Tensor) -> bool:
    """Whether the parameter may take `tensor`'s memory instead of a copy: a tensor alone in heap memory it owns
    whole (a dequantized GGUF weight; not a view of a mapped file, whose storage is not resizable), laid out as
    the parameter is. On a CPU load the copy would make the largest table (an embedding) resident twice."""
    storage = tensor.untyped_storage()
    return (
        tensor.dtype == param.dtype
        and tensor.device == param.device
        and not tensor.requires_grad
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and storage.resizable()
        and storage.nbytes() == tensor.numel() * tensor.element_size()
    )
