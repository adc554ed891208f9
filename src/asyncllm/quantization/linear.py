"""Linear layers over quantized weights: `QuantLinear` and its packed form, in the layout of
kernels/quant_matmul_ref.py (`qweight`, `scales`, `qzeros` or `mins`, every one [out, ...]).

The torch form computes the reference (dequantize in float32, then matmul); `enable_fused_kernels` (the Triton
backend) switches to the kernels: the one-launch GEMV up to `GEMV_MAX_TOKENS` tokens (where the layer's groups fit
its tiles), the weight-only Triton GEMM up to `DEQUANT_MIN_TOKENS` tokens, then a dequantized weight and cuBLAS;
FP8 with one scale per channel on Hopper from `W8A8_MIN_TOKENS` tokens runs W8A8 (`torch._scaled_mm`). The path
depends only on the step's token count, so CUDA graphs capture it. On CPU `use_cpu_int4` keeps the weight packed
for torch's int4 kernel (cpu_int4.py) instead, or, for a shape it cannot take, dequantized once. Under tensor
parallelism a row-parallel layer all-reduces its partial sums (`group`). Knows no checkpoint format.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import UnsupportedModelError
from asyncllm.kernels.quant_matmul_ref import FP8_DTYPE, codes_per_word, dequantize_ref, quant_matmul_ref
from asyncllm.layers.fusion import Fusable
from asyncllm.layers.linear import Packed
from asyncllm.layers.parallel import TPGroup
from asyncllm.quantization import cpu_int4
from asyncllm.quantization.scheme import QuantScheme

# Token counts from which a step takes each path (CUDA), from bench/kernels/bench_quant_matmul.py on the H200
# (bench/RESULTS.md, run 56): the GEMV halves int4's time at one row and loses from four (each row re-reads the
# weight); for FP8 it wins at one row up to ~2**25 weights and loses above, where the split-K GEMM already
# streams e4m3 at 2.5-3.4 TB/s (8B gate_up and down).
GEMV_MAX_TOKENS = 1
GEMV_MAX_FP8_WEIGHTS = 1 << 25
DEQUANT_MIN_TOKENS = 1024  # dequantize the whole weight to 16 bits, then cuBLAS
W8A8_MIN_TOKENS = 64  # FP8 with per-channel scales, bfloat16 activations, Hopper: torch._scaled_mm

_Matmul = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class QuantLinear(nn.Module, Fusable):
    """y = x W^T (+ b) for a quantized W [out_features, in_features]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        *,
        bias: nn.Parameter | None,
        device: torch.device,
        group: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits = scheme.bits
        self.group_size = in_features if scheme.group_size is None else scheme.group_size  # None: one per row
        groups = -(-in_features // self.group_size)
        if scheme.fp8:
            codes = torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
        else:
            per = codes_per_word(scheme.bits)
            if in_features % per:
                raise UnsupportedModelError(
                    f"a layer with {in_features} inputs cannot hold {scheme.bits}-bit codes packed {per} a word"
                )
            codes = torch.empty(out_features, in_features // per, dtype=torch.int32, device=device)
        self.qweight = nn.Parameter(codes, requires_grad=False)
        # Scales (and mins) keep the checkpoint's precision (float16, float32 for FP8), not the activations'.
        scale_dtype = getattr(torch, scheme.scale_dtype)

        def per_group(dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(out_features, groups, dtype=dtype, device=device), requires_grad=False)

        self.scales = per_group(scale_dtype)
        self.qzeros = per_group(torch.uint8) if scheme.zero_point else None
        self.mins = per_group(scale_dtype) if scheme.mins else None
        self.bias = bias
        self.group = group  # set: row-parallel, partial sums all-reduced before the bias
        self.scale_ub = scheme.activation_scale_ub
        self._matmul: _Matmul = self._reference
        self._scale_row: torch.Tensor | None = None  # [1, N] float32 for W8A8, when that path is taken
        self._gemv_locks: torch.Tensor | None = None  # quant_gemv's split-K counters, when that path is taken
        self._cpu_weight: cpu_int4.Int4Weight | torch.Tensor | None = None  # `use_cpu_int4`'s form of the weight

    @torch.no_grad()
    def fill_random(self, gen: torch.Generator, std: float) -> None:
        """Random codes and scales whose weights spread like N(0, std) (`load_format="dummy"`); the bias too."""
        if self.qweight.dtype == FP8_DTYPE:
            codes = torch.empty(self.qweight.shape, device=self.qweight.device).normal_(0.0, 64.0, generator=gen)
            self.qweight.copy_(codes.clamp(-448.0, 448.0))
            self.scales.fill_(std / 64.0)
        else:
            self.qweight.random_(generator=gen)  # every bit pattern: codes uniform over [0, 2**bits)
            spread = (2**self.bits) / 12**0.5  # a uniform code's standard deviation
            self.scales.fill_(std / spread)
            if self.qzeros is not None:
                self.qzeros.fill_(2 ** (self.bits - 1))
            if self.mins is not None:
                self.mins.fill_(-std * 3**0.5)  # codes * scale span [0, 2 std 3**0.5): centred
        if self.bias is not None:
            self.bias.normal_(0.0, std, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [T, in]
        if self.group is None:
            y = self._matmul(x2, self.bias)
        else:
            y = self.group.all_reduce(self._matmul(x2, None))
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y: torch.Tensor = quant_matmul_ref(
            x, self.qweight, self.scales, self.qzeros, bits=self.bits, group_size=self.group_size, bias=bias,
            mins=self.mins,
        )  # fmt: skip
        return y

    def use_cpu_int4(self, dtype: torch.dtype) -> bool:
        """Run from the weight in torch's CPU int4 form (True), or, where the layer's shape or codes do not fit
        it, from the weight dequantized once in `dtype` (False); the layout's tensors are released either way."""
        args = (self.qweight, self.scales, self.qzeros, self.mins)
        packed = cpu_int4.packable(
            self.out_features, self.in_features, self.bits, self.group_size, self.qweight.dtype == FP8_DTYPE
        )
        if packed:
            self._cpu_weight = cpu_int4.pack(*args, bits=self.bits, group_size=self.group_size)
            self._matmul = self._cpu_int4
        else:
            self._cpu_weight = dequantize_ref(*args[:3], bits=self.bits, group_size=self.group_size, mins=self.mins)
            self._cpu_weight = self._cpu_weight.to(dtype)
            self._matmul = self._cpu_dense
        for name in ("qweight", "scales", "qzeros", "mins"):
            param = getattr(self, name)
            if param is not None:  # emptied, not removed: the module keeps its attributes' types
                param.data = param.data.new_empty(0)
        return packed

    def _cpu_int4(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert isinstance(self._cpu_weight, cpu_int4.Int4Weight)
        return cpu_int4.int4_linear(x, self._cpu_weight, bias)

    def _cpu_dense(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert isinstance(self._cpu_weight, torch.Tensor)
        return F.linear(x, self._cpu_weight, bias)

    def enable_fused_kernels(self) -> None:
        device = self.qweight.device
        fp8 = self.qweight.dtype == FP8_DTYPE
        if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            # Triton has no e4m3 conversion there; shown once per process, not once per layer
            warnings.warn(
                "FP8 weights on a GPU before compute capability 8.9 run the reference path (slow)", stacklevel=2
            )
            return
        from asyncllm.kernels.fp8_scaled_mm import supports_w8a8

        per_channel = self.group_size == self.in_features
        if fp8 and per_channel and supports_w8a8(device) and self.out_features % 16 == 0 and self.in_features % 16 == 0:
            self._scale_row = self.scales.detach().reshape(1, -1).float().contiguous()  # [1, N]
        self.use_gemv(True)
        self._matmul = self._kernels

    @property
    def gemv(self) -> bool:
        """Whether steps of up to GEMV_MAX_TOKENS rows take the GEMV (once the kernels are on)."""
        return self._gemv_locks is not None

    def use_gemv(self, on: bool) -> None:
        """Take the GEMV up to GEMV_MAX_TOKENS rows where the layer's groups fit its tiles (for FP8 only up to
        GEMV_MAX_FP8_WEIGHTS weights), or never (ASYNCLLM_DECODE_GEMV=off: the split-K GEMM there instead)."""
        from asyncllm.kernels import gemv_plan as plans

        fp8 = self.qweight.dtype == FP8_DTYPE
        kind = plans.E4M3 if fp8 else self.bits
        n, k = self.out_features, self.in_features
        small = not fp8 or n * k <= GEMV_MAX_FP8_WEIGHTS
        config = plans.config_for(kind, n, k)
        if on and small and plans.gemv_plan(1, n, k, kind, self.group_size, 1, config=config) is not None:
            # allocated here, before any CUDA-graph capture; the kernel leaves them zero after every call
            self._gemv_locks = plans.gemv_locks(n, GEMV_MAX_TOKENS, self.qweight.device)
        else:
            self._gemv_locks = None

    def _kernels(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from asyncllm.kernels import quant_matmul as qm

        m = x.shape[0]
        if x.is_cuda and self._scale_row is not None and m >= W8A8_MIN_TOKENS and x.dtype == torch.bfloat16:
            from asyncllm.kernels.fp8_scaled_mm import fp8_w8a8_matmul

            y: torch.Tensor = fp8_w8a8_matmul(x, self.qweight, self._scale_row, bias=bias, scale_ub=self.scale_ub)
            return y
        if x.is_cuda and m >= DEQUANT_MIN_TOKENS:
            w = qm.dequantize(
                self.qweight, self.scales, self.qzeros, bits=self.bits, group_size=self.group_size, dtype=x.dtype,
                mins=self.mins,
            )  # fmt: skip
            return F.linear(x, w, bias)
        if self._gemv_locks is not None and m <= GEMV_MAX_TOKENS:
            from asyncllm.kernels.quant_matmul_gemv import quant_gemv

            y = quant_gemv(
                x if x.stride(1) == 1 else x.contiguous(), self.qweight, self.scales, self.qzeros, bits=self.bits,
                group_size=self.group_size, bias=bias, mins=self.mins, locks=self._gemv_locks,
            )  # fmt: skip
            return y
        out: torch.Tensor = qm.quant_matmul(
            x.contiguous(), self.qweight, self.scales, self.qzeros, bits=self.bits, group_size=self.group_size,
            bias=bias, mins=self.mins,
        )  # fmt: skip
        return out


class PackedQuantLinear(QuantLinear, Packed):
    """Several projections of one input (q/k/v, gate/up) stacked along the output rows, quantized."""

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        scheme: QuantScheme,
        *,
        bias: nn.Parameter | None,
        device: torch.device,
    ) -> None:
        super().__init__(in_features, sum(shards.values()), scheme, bias=bias, device=device)
        self._pack(shards)
