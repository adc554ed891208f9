"""A quantized checkpoint's tensors, as (name, tensor) pairs, turned into the layout of the quantized layers
(kernels/quant_matmul_ref.py): `qweight`, `scales`, `qzeros` per quantized module, every one [out, ...].

AWQ and GPTQ words are unpacked in their own orders (packing.py) and repacked along the input dim; their
[groups, out] scales and zero points are transposed; GPTQ's stored zero - 1 gets its 1 back, and a `g_idx`
that is not k // group_size (act-order) is refused. FP8 weights keep their bytes; per-tensor, per-channel and
block scales all become one row of group scales per output channel. A 16-bit checkpoint asked to run FP8 is
quantized here, one tensor at a time, on the load's device. Knows no model: which checkpoint modules are
quantized comes from `apply.quantize_linear_layers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from asyncllm.errors import UnsupportedModelError
from asyncllm.kernels.quant_matmul_ref import FP8_DTYPE, pack_codes, quantize_fp8_rows
from asyncllm.quantization.packing import awq_unpack, gptq_unpack_columns, gptq_unpack_rows
from asyncllm.quantization.scheme import CheckpointFormat, QuantScheme

# Tensors only a quantized module carries, in any supported format.
_QUANTIZED_PARAMS = frozenset(
    {"qweight", "qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "input_scale", "input_scale_ub"}
)
_FP8_SCALES = ("weight_scale", "weight_scale_inv")
# Static activation scales (fbgemm's cap is in the config; FP8 activations are scaled per token here).
_DROPPED = frozenset({"input_scale", "input_scale_ub"})

Weights = Iterator[tuple[str, torch.Tensor]]


class CheckpointConverter:
    """Converts one checkpoint's tensors; `quantized`: the checkpoint modules the model quantizes (with their
    layers' schemes: all `scheme` here)."""

    def __init__(self, scheme: QuantScheme, quantized: Mapping[str, QuantScheme], device: torch.device) -> None:
        self.scheme = scheme
        self.quantized = quantized
        self.device = device
        self._rows: dict[str, int] = {}  # FP8: the output rows of each module whose weight has passed
        self._waiting: dict[str, list[tuple[str, torch.Tensor]]] = {}  # FP8 scales that came before their weight

    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Weights:
        for name, tensor in weights:
            module, _, param = name.rpartition(".")
            if module in self.quantized:
                yield from self._convert(module, param, tensor)
            elif param in _QUANTIZED_PARAMS or tensor.dtype == FP8_DTYPE:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} belongs to a quantized {module!r}, which asyncllm keeps in the "
                    "model's dtype (an embedding, the LM head, or a module the quantization_config leaves out)"
                )
            else:
                yield name, tensor
        if self._waiting:
            module = next(iter(self._waiting))
            raise UnsupportedModelError(f"checkpoint has scales for {module!r} but no {module}.weight")

    def _convert(self, module: str, param: str, tensor: torch.Tensor) -> Weights:
        fmt = self.scheme.checkpoint
        if param == "bias":
            yield f"{module}.bias", tensor
        elif fmt is CheckpointFormat.AWQ:
            yield from self._awq(module, param, tensor)
        elif fmt in (CheckpointFormat.GPTQ, CheckpointFormat.GPTQ_V2):
            yield from self._gptq(module, param, tensor)
        elif fmt is CheckpointFormat.FP8:
            yield from self._fp8(module, param, tensor)
        else:
            assert fmt is CheckpointFormat.FLOAT, fmt
            if param != "weight":
                raise UnsupportedModelError(f"unexpected tensor {module}.{param} in an unquantized checkpoint")
            codes, scales = quantize_fp8_rows(tensor.to(self.device))
            yield f"{module}.qweight", codes
            yield f"{module}.scales", scales

    def _int(self, module: str, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor on the load's device; a float `weight` in a module quantized to integers is refused."""
        if param in ("qweight", "qzeros") and tensor.dtype != torch.int32:
            raise UnsupportedModelError(f"{module}.{param} has dtype {tensor.dtype}; {self.scheme.method} packs int32")
        if param == "weight":
            raise UnsupportedModelError(
                f"checkpoint stores {module}.weight unquantized, but its quantization_config quantizes {module}"
            )
        return tensor.to(self.device)

    def _awq(self, module: str, param: str, tensor: torch.Tensor) -> Weights:
        t = self._int(module, param, tensor)
        if param == "qweight":  # [K, N/8] -> codes [K, N] -> ours [N, K/8]
            yield f"{module}.qweight", pack_codes(awq_unpack(t).t(), 4)
        elif param == "qzeros":  # [K/G, N/8] -> [N, K/G]
            yield f"{module}.qzeros", awq_unpack(t).t().to(torch.uint8).contiguous()
        elif param == "scales":  # [K/G, N] -> [N, K/G]
            yield f"{module}.scales", t.t().contiguous()
        else:
            yield f"{module}.{param}", tensor  # the loader names anything it has no place for

    def _gptq(self, module: str, param: str, tensor: torch.Tensor) -> Weights:
        t = self._int(module, param, tensor)
        bits = self.scheme.bits
        if param == "qweight":  # [K/P, N] -> codes [K, N] -> ours [N, K/P]
            yield f"{module}.qweight", pack_codes(gptq_unpack_rows(t, bits).t(), bits)
        elif param == "qzeros":  # [K/G, N/P] -> [N, K/G]
            zeros = gptq_unpack_columns(t, bits)
            if self.scheme.checkpoint is CheckpointFormat.GPTQ:  # stored as zero - 1 (AutoGPTQ's "v1" layout)
                zeros = (zeros + 1) & ((1 << bits) - 1)
            yield f"{module}.qzeros", zeros.t().to(torch.uint8).contiguous()
        elif param == "scales":
            yield f"{module}.scales", t.t().contiguous()
        elif param == "g_idx":
            self._check_g_idx(module, t)  # carries nothing once checked
        else:
            yield f"{module}.{param}", tensor

    def _check_g_idx(self, module: str, g_idx: torch.Tensor) -> None:
        k = g_idx.numel()
        group = self.scheme.group_size or k
        expected = torch.arange(k, device=g_idx.device) // group
        if not torch.equal(g_idx.flatten().to(expected.dtype), expected):
            raise UnsupportedModelError(
                f"{module}.g_idx reorders the input channels' groups (GPTQ act-order, desc_act=true), which "
                "asyncllm does not support: use a checkpoint quantized with desc_act=false"
            )

    def _fp8(self, module: str, param: str, tensor: torch.Tensor) -> Weights:
        if param in _DROPPED:
            return
        if param == "weight":
            if tensor.dtype != FP8_DTYPE:
                raise UnsupportedModelError(
                    f"{module}.weight has dtype {tensor.dtype}; {self.scheme.method} checkpoints are read as "
                    "float8_e4m3fn"
                )
            self._rows[module] = tensor.shape[0]
            yield f"{module}.qweight", tensor.to(self.device)
            for scale_param, scale in self._waiting.pop(module, []):
                yield f"{module}.scales", self._fp8_scales(module, scale_param, scale)
        elif param in _FP8_SCALES:
            if module in self._rows:
                yield f"{module}.scales", self._fp8_scales(module, param, tensor)
            else:
                self._waiting.setdefault(module, []).append((param, tensor))
        else:
            yield f"{module}.{param}", tensor

    def _fp8_scales(self, module: str, param: str, scale: torch.Tensor) -> torch.Tensor:
        """Any FP8 scale tensor as [N, groups] float32, one row per output channel."""
        rows = self._rows[module]
        scale = scale.to(self.device, torch.float32)
        if scale.numel() == 1:  # per tensor
            return scale.reshape(1, 1).expand(rows, 1).contiguous()
        if self.scheme.group_size is None:  # per channel
            if scale.numel() != rows:
                raise UnsupportedModelError(
                    f"{module}.{param} has shape {tuple(scale.shape)}: neither one scale nor one per output channel "
                    f"({rows})"
                )
            return scale.reshape(rows, 1)
        block = self.scheme.block_rows
        if scale.dim() != 2 or scale.shape[0] != -(-rows // block):
            raise UnsupportedModelError(
                f"{module}.{param} has shape {tuple(scale.shape)}: not one scale per {block}x{self.scheme.group_size}"
                f" block of a weight with {rows} rows"
            )
        return scale.repeat_interleave(block, dim=0)[:rows].contiguous()
