"""Loading checkpoint-named tensors into a model whose projections may be packed (q/k/v, gate/up).

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
from asyncllm.models.family import WeightPlan

# checkpoint module name -> (packed module name, shard)
PackedNames = Mapping[str, tuple[str, str]]

_Slot = tuple[str, str | None]  # (our parameter name, shard or None for an unpacked parameter)


def load_planned_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], plan: WeightPlan, tied: bool
) -> None:
    """`load_packed_weights` with the plan's packing; drops the plan's ignored extras and, when the head is
    tied to the embedding, a checkpoint's copy of the head."""
    head = f"{plan.lm_head}.weight"

    def skip(name: str) -> bool:
        return name.endswith(plan.ignored_suffixes) or (tied and name == head)

    load_packed_weights(model, weights, plan.packed, skip)


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: PackedNames,
    skip: Callable[[str], bool],
) -> None:
    """Copy every checkpoint tensor into its (shard of a) parameter; `skip(name)` drops known extras."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    unpacked = {ours_and_shard: hf for hf, ours_and_shard in packed.items()}
    loaded: set[_Slot] = set()
    for hf_name, tensor in weights:
        if skip(hf_name):
            continue
        slot = _to_slot(hf_name, packed)
        name, shard = slot
        if name not in params:
            raise UnsupportedModelError(
                f"checkpoint weight {hf_name!r} has no place in {type(model).__name__}: the checkpoint does "
                "not match its config.json architecture, or uses a variant asyncllm does not support"
            )
        if slot in loaded:
            raise UnsupportedModelError(f"checkpoint weight {hf_name!r} appears twice")
        if shard is None:
            _copy(params[name], tensor, hf_name)
        else:
            module_name, _, attr = name.rpartition(".")
            layer = modules[module_name]
            assert isinstance(layer, Packed), module_name
            layer.load_shard(attr, shard, tensor)
        loaded.add(slot)
    missing = sorted(_hf_name(s, unpacked) for s in _expected_slots(params, modules) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UnsupportedModelError(
            f"checkpoint is missing {len(missing)} weight(s) of {type(model).__name__}: {shown}"
        )


def _to_slot(hf_name: str, packed: PackedNames) -> _Slot:
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in packed:
        ours, shard = packed[parts[-2]]
        return ".".join([*parts[:-2], ours, parts[-1]]), shard
    return hf_name, None


def _hf_name(slot: _Slot, unpacked: dict[tuple[str, str], str]) -> str:
    """Our slot back to the checkpoint name it should have come from (for error messages)."""
    name, shard = slot
    if shard is None:
        return name
    prefix, module, attr = name.rsplit(".", 2)
    return f"{prefix}.{unpacked[(module, shard)]}.{attr}"


def _expected_slots(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> set[_Slot]:
    slots: set[_Slot] = set()
    for name in params:
        module_name, _, _ = name.rpartition(".")
        layer = modules[module_name]
        if isinstance(layer, Packed):
            slots.update((name, shard) for shard in layer.shard_sizes)
        else:
            slots.add((name, None))
    return slots


def _copy(param: nn.Parameter, tensor: torch.Tensor, hf_name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise UnsupportedModelError(
            f"checkpoint weight {hf_name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(param.shape)}: the config and the weights disagree"
        )
    with torch.no_grad():
        param.copy_(tensor)
