"""Which quantization a model runs with: the checkpoint's `quantization_config` (AWQ, GPTQ, compressed-tensors
float-quantized, fbgemm_fp8, fp8) or the `quantization` engine argument, read into one frozen `QuantScheme`.

Everything the loaders and layers need is decided here, once, and anything they could not honour is refused
here, naming the config field and its value. Plain Python (the scheme crosses to tensor-parallel workers);
knows no tensor, file or model.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from asyncllm.errors import UnsupportedModelError
from asyncllm.quantization.gguf_types import GGUF_KEPT, Layout, joined

logger = logging.getLogger("asyncllm")


class CheckpointFormat(Enum):
    """How the checkpoint stores a quantized linear layer (convert.py turns each into our layout)."""

    AWQ = "awq"  # qweight [K, N/8] int32 in AWQ's nibble order, qzeros [K/G, N/8], scales [K/G, N]
    GPTQ = "gptq"  # qweight [K/P, N], qzeros [K/G, N/P] holding zero - 1, scales [K/G, N], g_idx [K]
    GPTQ_V2 = "gptq_v2"  # the same with the zero points themselves
    FP8 = "fp8"  # weight [N, K] e4m3 and weight_scale (or weight_scale_inv): per tensor, channel or block
    FLOAT = "float"  # an unquantized checkpoint, quantized to e4m3 per output channel at load
    GGUF = "gguf"  # a GGUF file's blocks, repacked as the file is read (model_loader/gguf/repack.py)


@dataclass(frozen=True)
class QuantScheme:
    """One model's quantized linear layers: codes, their grouping, and where they come from."""

    method: str  # the checkpoint's quant_method ("fp8" when quantizing at load): for messages and logs
    checkpoint: CheckpointFormat
    fp8: bool  # e4m3 codes; else unsigned integer codes of `bits` bits
    bits: int  # 4 or 8
    group_size: int | None  # inputs sharing a scale along K; None: one scale per output channel
    zero_point: bool = False  # integer codes carry zero points (w = (q - z) * s); else w = q * s
    mins: bool = False  # integer codes carry per-group offsets (w = q * s + m: GGUF's Q4_1)
    scale_dtype: str = "float16"  # how scales (and mins) are kept: the checkpoint's own precision
    block_rows: int = 1  # FP8 block scales: output rows sharing a scale (expanded to one per row at load)
    activation_scale_ub: float | None = None  # W8A8: per-token activation scales are capped at this
    skip_substrings: tuple[str, ...] = ()  # checkpoint modules left unquantized: any containing one of these
    skip_patterns: tuple[str, ...] = ()  # ... or matching one of these regular expressions (re.match)
    # GGUF: (checkpoint module, tensor type) of each linear module; a layer takes the layout of its modules'
    # types (gguf_types.py), or stays unquantized where one of them is not kept. Empty: every layer is this one.
    module_types: tuple[tuple[str, str], ...] = ()
    # On CPU: run from torch's int4 kernel (quantization/cpu_int4.py), the LM head too where `head_type` (the
    # GGUF type the head is stored in, None where unknown) holds 8 bits or fewer; False: the reference matmul.
    cpu_int4: bool = False
    head_type: str | None = None

    def skips(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. model.layers.0.mlp.down_proj) stays unquantized."""
        return any(s in module for s in self.skip_substrings) or any(re.match(p, module) for p in self.skip_patterns)

    def layer_scheme(self, modules: Sequence[str]) -> QuantScheme | None:
        """The scheme of the one linear layer that computes the checkpoint modules `modules` (a packed layer has
        several; it is quantized whole), or None where it stays unquantized."""
        skipped = [n for n in modules if self.skips(n)]
        if len(skipped) == len(modules):
            return None
        if skipped:
            raise UnsupportedModelError(
                f"{self.method} checkpoint leaves {skipped} unquantized but quantizes "
                f"{sorted(set(modules) - set(skipped))}; asyncllm runs them as one packed layer, which must be "
                "quantized whole"
            )
        if not self.module_types:
            return self
        types = dict(self.module_types)
        found = [types.get(n) for n in modules]
        if any(t not in GGUF_KEPT for t in found):
            return None  # dequantized at load, like a file whose types are not kept
        layout = joined(GGUF_KEPT[t] for t in found if t is not None)
        return _with_layout(dataclasses.replace(self, module_types=()), layout, ", ".join(sorted(set(map(str, found)))))

    def describe(self) -> str:
        """One line for logs, e.g. "awq: int4, 128 inputs per scale, zero points"."""
        codes = "e4m3" if self.fp8 else f"int{self.bits}"
        groups = "one scale per output channel" if self.group_size is None else f"{self.group_size} inputs per scale"
        if self.block_rows > 1:
            groups = f"{self.block_rows}x{self.group_size} blocks"
        offsets = ", zero points" if self.zero_point else ", mins" if self.mins else ""
        if len({t for _, t in self.module_types}) > 1:  # a file mixing types: each layer has its own layout
            return f"{self.method}: each layer in its tensor types' layout, at most {codes}, {groups}{offsets}"
        return f"{self.method}: {codes}, {groups}{offsets}"


def fp8_at_load() -> QuantScheme:
    """`quantization="fp8"` on an unquantized checkpoint: e4m3 codes, one float32 scale per output channel."""
    return QuantScheme("fp8", CheckpointFormat.FLOAT, fp8=True, bits=8, group_size=None, scale_dtype="float32")


def resolve_quantization(
    requested: str | None, quantization_config: Any, device_type: str = "cuda", cpu_int4: bool = False
) -> QuantScheme | None:
    """The scheme for a checkpoint whose config.json holds `quantization_config` (None: unquantized), given the
    `quantization` engine argument's value (None: follow the checkpoint) and the device type ("cuda", "cpu").
    `cpu_int4`: on CPU, integer codes run from torch's int4 kernel (the caller checked the CPU has it fast),
    and a GGUF file's linear layers stay quantized by default."""
    scheme = _resolve(requested, quantization_config, device_type, cpu_int4 and device_type == "cpu")
    if scheme is not None and cpu_int4 and device_type == "cpu" and not scheme.fp8:
        return dataclasses.replace(scheme, cpu_int4=True)
    return scheme


def _resolve(requested: str | None, quantization_config: Any, device_type: str, cpu_int4: bool) -> QuantScheme | None:
    if isinstance(quantization_config, Mapping) and quantization_config.get("quant_method") == "gguf":
        return _gguf_choice(requested, quantization_config, device_type, cpu_int4)
    if not quantization_config:
        if requested is None:
            return None
        if requested == "fp8":
            return fp8_at_load()
        raise UnsupportedModelError(
            f"quantization={requested!r} needs a checkpoint quantized with {requested.upper()} (its config.json "
            "has a quantization_config); this checkpoint is unquantized. quantization='fp8' quantizes one at load"
        )
    if not isinstance(quantization_config, Mapping):
        raise UnsupportedModelError(f"quantization_config is {type(quantization_config).__name__}, not a mapping")
    scheme = checkpoint_scheme(quantization_config)
    wanted = "fp8" if scheme.fp8 else scheme.method
    if requested is not None and requested != wanted:
        raise UnsupportedModelError(
            f"quantization={requested!r}, but the checkpoint is quantized with {scheme.method} ({scheme.describe()}): "
            f"pass quantization={wanted!r} or leave it unset"
        )
    return scheme


def _gguf_choice(requested: str | None, qc: Mapping[str, Any], device_type: str, cpu_int4: bool) -> QuantScheme | None:
    """A GGUF file: its linear layers kept quantized by default on CUDA and on a CPU with the int4 kernel (when
    their types allow), dequantized at load on other CPUs (there float32 weights are what the GEMMs read
    fastest) or when asked for FP8."""
    if requested == "fp8":
        return fp8_at_load()  # of the dequantized weights
    if requested not in (None, "gguf"):
        raise UnsupportedModelError(
            f"quantization={requested!r}, but the checkpoint is a GGUF file: pass 'gguf' or 'fp8'"
        )
    if requested is None and device_type != "cuda" and not cpu_int4:
        return None
    try:
        return gguf_scheme(qc)
    except UnsupportedModelError as exc:
        if requested is not None:
            raise
        logger.info("GGUF linear layers dequantized at load: %s", exc)
        return None


def gguf_scheme(qc: Mapping[str, Any]) -> QuantScheme:
    """The scheme of a GGUF file: its linear layers of the types asyncllm keeps (`GGUF_KEPT`), each in its
    type's layout (a packed layer: the layout joining its shards' types), the others dequantized at load.
    `qc`: {"linear_types": every linear tensor's type, "module_types": {checkpoint module: type}} (without
    "module_types", every linear layer has the file's one type)."""
    types = qc.get("linear_types") or []
    module_types = qc.get("module_types") or {}
    kept = [t for t in types if t in GGUF_KEPT]
    if not kept or (not module_types and len(types) != 1):
        raise UnsupportedModelError(
            f"the GGUF file's linear layers are {', '.join(types) or 'absent'}; kept quantized are linear layers "
            f"of the types {', '.join(GGUF_KEPT)}"
        )
    if len(kept) < len(types):
        logger.info("GGUF linear layers of types %s dequantized at load", ", ".join(t for t in types if t not in kept))
    base = QuantScheme("gguf", CheckpointFormat.GGUF, fp8=False, bits=8, group_size=32,
                       module_types=tuple(sorted(module_types.items())), head_type=qc.get("head_type"))  # fmt: skip
    return _with_layout(base, joined(GGUF_KEPT[t] for t in kept), ", ".join(kept))


def _with_layout(scheme: QuantScheme, layout: Layout, types: str) -> QuantScheme:
    return dataclasses.replace(
        scheme, method=f"gguf {types}", bits=layout.bits, group_size=layout.group_size,
        zero_point=layout.zero_point, mins=not layout.zero_point, scale_dtype=layout.scale_dtype,
    )  # fmt: skip


def checkpoint_scheme(qc: Mapping[str, Any]) -> QuantScheme:
    """The scheme a checkpoint's `quantization_config` describes; UnsupportedModelError naming the first field
    asyncllm cannot honour."""
    method = qc.get("quant_method")
    readers = {
        "awq": _awq,
        "gptq": _gptq,
        "compressed-tensors": _compressed_tensors,
        "fbgemm_fp8": _fbgemm_fp8,
        "fp8": _fp8,
    }
    if method not in readers:
        raise UnsupportedModelError(
            f"quantization_config.quant_method={method!r} is not supported; supported: {', '.join(readers)} "
            "(docs/quantization.md)"
        )
    return readers[method](qc)


def _refuse(method: str, field: str, value: object, supported: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{method} checkpoint: quantization_config.{field}={value!r} is not supported ({supported})"
    )


def _group_size(method: str, field: str, value: object) -> int | None:
    if value == -1:
        return None  # one group over each whole row
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse(method, field, value, "a positive number of inputs per scale, or -1")
    return value


def _not_converted(qc: Mapping[str, Any], field: str = "modules_to_not_convert") -> tuple[str, ...]:
    names = qc.get(field) or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UnsupportedModelError(f"quantization_config.{field}={names!r} is not a list of module names")
    return tuple(names)


def _awq(qc: Mapping[str, Any]) -> QuantScheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse("awq", "bits", bits, "AWQ checkpoints are read with 4-bit codes")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", "version", qc.get("version"), "only the GEMM layout: requantize with version='gemm'")
    if not qc.get("zero_point", True):
        raise _refuse("awq", "zero_point", qc.get("zero_point"), "AWQ is read with zero points")
    group = _group_size("awq", "group_size", qc.get("group_size", qc.get("q_group_size")))
    return QuantScheme(
        "awq", CheckpointFormat.AWQ, fp8=False, bits=4, group_size=group, zero_point=True,
        skip_substrings=_not_converted(qc),
    )  # fmt: skip


def _gptq(qc: Mapping[str, Any]) -> QuantScheme:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _refuse("gptq", "bits", bits, "4 or 8")
    layout = qc.get("checkpoint_format", "gptq")
    if layout not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", "checkpoint_format", layout, "'gptq' or 'gptq_v2'")
    if qc.get("lm_head"):
        raise _refuse("gptq", "lm_head", qc.get("lm_head"), "the LM head stays unquantized")
    if qc.get("dynamic"):
        raise _refuse("gptq", "dynamic", qc.get("dynamic"), "one scheme for every layer")
    # desc_act (act-order) is checked on the tensors: a g_idx that is not k // group_size is refused at load.
    fmt = CheckpointFormat.GPTQ if layout == "gptq" else CheckpointFormat.GPTQ_V2
    group = _group_size("gptq", "group_size", qc.get("group_size"))
    return QuantScheme(
        "gptq", fmt, fp8=False, bits=bits, group_size=group, zero_point=True, skip_substrings=_not_converted(qc)
    )


def _fbgemm_fp8(qc: Mapping[str, Any]) -> QuantScheme:
    ub = qc.get("activation_scale_ub")
    if ub is not None and (isinstance(ub, bool) or not isinstance(ub, (int, float)) or ub <= 0):
        raise _refuse("fbgemm_fp8", "activation_scale_ub", ub, "a positive number")
    return QuantScheme(
        "fbgemm_fp8", CheckpointFormat.FP8, fp8=True, bits=8, group_size=None, scale_dtype="float32",
        activation_scale_ub=None if ub is None else float(ub), skip_substrings=_not_converted(qc),
    )  # fmt: skip


def _fp8(qc: Mapping[str, Any]) -> QuantScheme:
    """transformers' / vLLM's "fp8": per-tensor scales, or per-block with `weight_block_size` (Qwen3-*-FP8)."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fp8", "fmt", fmt, "'e4m3'")
    if qc.get("scale_fmt", "float") not in ("float", None):
        raise _refuse("fp8", "scale_fmt", qc.get("scale_fmt"), "float32 scales")
    block = qc.get("weight_block_size")
    rows, group = 1, None
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise _refuse("fp8", "weight_block_size", block, "[rows, columns] of positive integers")
        rows, group = block
    skip = _not_converted(qc) + _not_converted(qc, "ignored_layers")
    return QuantScheme("fp8", CheckpointFormat.FP8, fp8=True, bits=8, group_size=group, block_rows=rows,
                       scale_dtype="float32", skip_substrings=skip)  # fmt: skip


def _check_kv_cache_scheme(method: str, scheme: Any) -> None:
    """compressed-tensors' `kv_cache_scheme`: how the checkpoint's k_scale / v_scale tensors were calibrated,
    which an FP8 KV cache (kv_cache_dtype="fp8") stores keys and values with (model_loader/kv_scales.py; the
    linear layers' scheme is unaffected). Accepted: what that cache honours, one static scale per layer."""
    if not scheme:
        return
    if not isinstance(scheme, Mapping):
        raise _refuse(method, "kv_cache_scheme", scheme, "a mapping")
    for field, wanted, why in (
        ("type", "float", "e4m3 codes"),
        ("num_bits", 8, "e4m3 codes"),
        ("strategy", "tensor", "one scale per layer for keys and one for values"),
        ("dynamic", False, "scales read from the checkpoint"),
        ("symmetric", True, "e4m3 codes without zero points"),
    ):
        value = scheme.get(field, wanted if field in ("strategy", "dynamic", "symmetric") else None)
        if value != wanted:
            raise _refuse(method, f"kv_cache_scheme.{field}", value, f"{wanted!r}: the FP8 KV cache reads {why}")


def _compressed_tensors(qc: Mapping[str, Any]) -> QuantScheme:
    method = "compressed-tensors"
    if qc.get("format") != "float-quantized":
        raise _refuse(method, "format", qc.get("format"), "'float-quantized' (FP8 weights)")
    _check_kv_cache_scheme(method, qc.get("kv_cache_scheme"))
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise _refuse(method, "config_groups", groups, "exactly one group")
    name, group = next(iter(groups.items()))
    field = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise _refuse(method, f"{field}.targets", group.get("targets"), "['Linear']")
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        found = (weights.get("type"), weights.get("num_bits"))
        raise _refuse(method, f"{field}.weights (type, num_bits)", found, "('float', 8): FP8 weights")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        found = (weights.get("symmetric"), weights.get("dynamic"))
        raise _refuse(method, f"{field}.weights (symmetric, dynamic)", found, "symmetric, static weights")
    strategy = weights.get("strategy")
    rows, columns = 1, None
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise _refuse(method, f"{field}.weights.block_structure", block, "[rows, columns] of positive integers")
        rows, columns = block
    elif strategy not in ("channel", "tensor"):
        raise _refuse(method, f"{field}.weights.strategy", strategy, "'channel', 'tensor' or 'block'")
    acts = group.get("input_activations")
    if acts is not None and (acts.get("type") != "float" or acts.get("num_bits") != 8):
        found = (acts.get("type"), acts.get("num_bits"))
        raise _refuse(method, f"{field}.input_activations (type, num_bits)", found, "('float', 8), or none")
    if group.get("output_activations"):
        raise _refuse(method, f"{field}.output_activations", group.get("output_activations"), "none")
    ignore = _not_converted(qc, "ignore")
    patterns = tuple(p[3:] if p.startswith("re:") else re.escape(p) + "$" for p in ignore)
    return QuantScheme(method, CheckpointFormat.FP8, fp8=True, bits=8, group_size=columns, block_rows=rows,
                       scale_dtype="float32", skip_patterns=patterns)  # fmt: skip
