"""Reading a LoRA adapter saved by PEFT (`adapter_config.json` + `adapter_model.safetensors`), checked.

Owns PEFT's format: the config's rank, alpha and rsLoRA flag (the scaling alpha / r, or alpha / sqrt(r)), the
tensor names (`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]), and every
variant asyncllm does not serve (DoRA, trained biases, extra saved modules, per-module ranks, ...), refused by
name. Adapters arrive under the base checkpoint's module names; which of them a model can take, and their
shapes, are the model's business (`models/lora.py`). Knows nothing of devices or slots.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncllm.errors import LoRAError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}

# Config entries that change the maths beyond W + B A * scaling: refused unless empty or off.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    "lora_bias": "a trained LoRA bias",
    "modules_to_save": "modules_to_save (whole modules saved beside the adapter)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on parameters, e.g. MoE experts)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "use_qalora": "QA-LoRA",
}


@dataclass(frozen=True)
class PeftAdapter:
    rank: int
    scaling: float  # folded into B when packed
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # base module name -> (A [r, in], B [out, r]), float32


def read_peft_adapter(path: str | Path, max_lora_rank: int) -> PeftAdapter:
    """The adapter at `path`, or `LoRAError` naming what is missing, malformed or unsupported."""
    directory = Path(path)
    config = _read_config(directory)
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{directory / CONFIG}: r={rank!r} is not a positive integer rank")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{directory / CONFIG}: lora_alpha={alpha!r} is not a number")
    if rank > max_lora_rank:
        raise LoRAError(
            f"the adapter at {directory} has rank r={rank}, above this engine's max_lora_rank={max_lora_rank}: "
            f"build the engine with max_lora_rank >= {rank}"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return PeftAdapter(rank, float(scaling), _read_tensors(directory, rank))


def _read_config(directory: Path) -> dict[str, Any]:
    file = directory / CONFIG
    if not file.is_file():
        raise LoRAError(f"no LoRA adapter at {directory}: {CONFIG} is missing (a PEFT adapter directory has it)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{file} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{file} holds {type(config).__name__}, not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{file}: peft_type={peft_type!r}; only LoRA adapters (peft_type 'LORA') are supported")
    used = [what for key, what in _UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        used.append(f"bias={config['bias']!r} (trained biases)")
    if used:
        raise LoRAError(f"the adapter at {directory} uses {', '.join(used)}, which asyncllm does not support")
    return config


def _read_tensors(directory: Path, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    file = directory / WEIGHTS
    if not file.is_file():
        found = sorted(p.name for p in directory.iterdir())
        raise LoRAError(
            f"no {WEIGHTS} in {directory} (found: {', '.join(found) or 'nothing'}); save the adapter with "
            "PEFT's save_pretrained (safetensors, its default)"
        )
    from safetensors import SafetensorError, safe_open

    halves: dict[str, list[torch.Tensor | None]] = {}
    strange: list[str] = []
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                module, which = _split_name(key)
                if module is None:
                    strange.append(key)
                    continue
                halves.setdefault(module, [None, None])[which] = f.get_tensor(key).float()
    except (SafetensorError, OSError) as exc:
        raise LoRAError(f"{file} cannot be read as safetensors: {exc}") from None
    if strange:
        kinds = sorted({re.sub(r"\.\d+\.", ".*.", key.removeprefix(_PREFIX)) for key in strange})
        modules = sorted({m for m in map(_embedding_module, kinds) if m is not None})
        if all(_embedding_module(k) for k in kinds):
            raise LoRAError(
                f"the adapter targets {', '.join(modules)}: asyncllm applies LoRA to linear layers only, not to "
                "embeddings or the LM head"
            )
        raise LoRAError(
            f"{file} holds tensors asyncllm cannot apply: {', '.join(kinds[:4])}"
            + (f" and {len(kinds) - 4} more" if len(kinds) > 4 else "")
            + " (only lora_A / lora_B weights of linear layers: no embedding LoRA, DoRA magnitudes or saved modules)"
        )
    if not halves:
        raise LoRAError(f"{file} holds no LoRA weights")
    tensors = {}
    for module, (a, b) in sorted(halves.items()):
        if a is None or b is None:
            raise LoRAError(
                f"{file}: {module} has lora_{'B' if a is None else 'A'} without its lora_{'A' if a is None else 'B'}"
            )
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(
                f"{file}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, not the config's rank "
                f"r={rank} ([r, in] and [out, r])"
            )
        tensors[module] = (a, b)
    return tensors


def _embedding_module(name: str) -> str | None:
    """The embedding (or LM head) a tensor PEFT saves for LoRA on it belongs to; None for any other tensor."""
    for marker in (".lora_embedding_A", ".lora_embedding_B", ".base_layer.weight"):
        if marker in name:
            return name[: name.index(marker)]
    return None


def _split_name(key: str) -> tuple[str | None, int]:
    """(base module name, 0 for A / 1 for B), or (None, 0) for a tensor that is no linear layer's LoRA."""
    for suffix, which in _SUFFIXES.items():
        if key.startswith(_PREFIX) and key.endswith(suffix):
            return key[len(_PREFIX) : -len(suffix)], which
    return None, 0
