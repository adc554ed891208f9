"""The dense linear layer (`Linear`: F.linear, or at one token row the one-launch GEMV where it was chosen, with
the norm or SiLU-and-mul before it folded in where layers/prologue.py pairs them) and the layers whose weight
packs several checkpoint tensors (q/k/v, gate/up) into one matmul.

A packed layer (`Packed`: plain or quantized) knows the row range of each named shard and copies checkpoint
tensors into it, recording which shards arrived so a model can report any it never received. Parameters are
uninitialised: every one is loaded. Knows nothing about checkpoint names; models map Hugging Face names to
(layer, shard).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.fusion import LaunchesPdl
from asyncllm.layers.param_dtype import empty_parameter


class Linear(nn.Module, LaunchesPdl):
    """y = x W^T (+ b), W [out, in]; like nn.Linear without the random initialisation. At one token row it can
    take the one-launch GEMV instead of F.linear (`use_gemv`; worker/gemm_layout.py decides where)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features)
        self.bias = empty_parameter(out_features) if bias else None
        self._no_gemv()

    def _no_gemv(self) -> None:
        self._gemv: Callable[..., torch.Tensor] | None = None  # kernels' linear_gemv, once use_gemv(True) ran
        self._gemv_locks: torch.Tensor | None = None  # its split-K counters, allocated before any graph capture
        self._prologue: ModuleType | None = None  # the kernels' module, once use_prologue_gemv(True) ran
        self._pdl = False  # the GEMV's launches programmatic dependents (use_pdl)
        self._prefetch = False  # with them, each program asks L2 for its weights before it waits (use_pdl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias): the GEMV at one token row where it is on, else F.linear. The path depends only on
        the row count, so CUDA graphs capture it."""
        if self._gemv is not None and x.dim() == 2 and x.shape[0] == 1:
            x = x if x.stride(1) == 1 else x.contiguous()
            return self._gemv(x, self.weight, bias, locks=self._gemv_locks, pdl=self._pdl, prefetch=self._prefetch)
        return F.linear(x, self.weight, bias)

    @property
    def gemv(self) -> bool:
        """Whether one token row takes the GEMV."""
        return self._gemv is not None

    def use_gemv(self, on: bool) -> None:
        """Take the one-launch GEMV (kernels/quant_matmul_gemv.py, a Triton kernel: CUDA, or the interpreter)
        at one token row, or stop. It reads the weight in its [out, in] layout, of a float type."""
        if not on:
            self._gemv = None
            return
        self._check_gemv_weight()
        from asyncllm.kernels.quant_matmul_gemv import gemv_locks, linear_gemv

        if self._gemv_locks is None:
            self._gemv_locks = gemv_locks(self.weight.shape[0], 1, self.weight.device)
        self._gemv = linear_gemv

    def _check_gemv_weight(self) -> None:
        weight = self.weight
        if weight.stride(1) != 1 or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(
                f"the GEMV reads [out, in] float weights with contiguous rows; this layer's is {weight.dtype} "
                f"with strides {weight.stride()}"
            )

    @property
    def prologue_gemv(self) -> bool:
        """Whether one token row reaching this layer through layers/prologue.py folds the op before it (a
        norm, or SiLU-and-mul) into its GEMV."""
        return self._prologue is not None

    def use_prologue_gemv(self, on: bool) -> None:
        """Fold the op before this layer into its one-row GEMV where layers/prologue.py pairs them, or stop;
        the weight as `use_gemv` reads it. Calls without a prologue keep the layer's other paths."""
        if not on:
            self._prologue = None
            return
        self._check_gemv_weight()
        from asyncllm.kernels import quant_matmul_gemv

        if self._gemv_locks is None:
            self._gemv_locks = quant_matmul_gemv.gemv_locks(self.weight.shape[0], 1, self.weight.device)
        self._prologue = quant_matmul_gemv

    def project_normed(
        self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([1, out], x + residual or None)
        """One token row: rms_norm(x (+ residual)) W^T (+ b) in one launch (`prologue_gemv` on)."""
        assert self._prologue is not None and x.shape[0] == 1
        return self._prologue.rms_norm_gemv(  # type: ignore[no-any-return]
            x,
            norm_weight,
            eps,
            self.weight,
            self.bias,
            residual=residual,
            locks=self._gemv_locks,
            pdl=self._pdl,
            prefetch=self._prefetch,
        )

    def project_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """One token row: (silu(gate) * up) W^T (+ b) of x = [gate | up] in one launch (`prologue_gemv` on)."""
        assert self._prologue is not None and x.shape[0] == 1
        return self._prologue.silu_mul_gemv(  # type: ignore[no-any-return]
            x, self.weight, self.bias, locks=self._gemv_locks, pdl=self._pdl, prefetch=self._prefetch
        )

    def use_pdl(self, on: bool) -> None:
        self._pdl = on
        # The prefetch before the wait pays where the weight fits half the L2 beside the other kernels' traffic
        # (Qwen3-0.6B's layers, 12.6 MB at most: 44.5 -> 42.7 us a layer) and costs where it streams past it
        # (Qwen3-8B's, 32-200 MB: 195 -> 211 us; bench/RESULTS.md, 2026-12-07 fourteenth session).
        weight = self.weight
        if on and weight.device.type == "cuda":
            l2_bytes = torch.cuda.get_device_properties(weight.device).L2_cache_size
            self._prefetch = weight.numel() * weight.element_size() <= l2_bytes // 2
        else:
            self._prefetch = False

    def store_weight_transposed(self) -> None:
        """Keep the weight's memory [in, out] while it stays an [out, in] view: the same maths, but cuBLAS
        then runs the transposed-layout GEMM (faster for some shapes; worker/gemm_layout.py decides)."""
        assert self._gemv is None and self._prologue is None, "the GEMV reads the [out, in] layout"
        with torch.no_grad():
            self.weight.data = self.weight.data.t().contiguous().t()


class Packed:
    """The shard bookkeeping of a layer whose output rows stack several projections of the same input, in
    `shards` order. Every parameter of such a layer is [out, ...] (the quantized forms' codes, scales and zero
    points too), so a shard's rows are the same slice of each; the weight loader asks any `Packed` layer."""

    shard_sizes: dict[str, int]
    _offsets: dict[str, int]
    bias: nn.Parameter | None

    def _pack(self, shards: dict[str, int]) -> None:
        self.shard_sizes = dict(shards)
        self._offsets = {}
        offset = 0
        for name, size in shards.items():
            self._offsets[name] = offset
            offset += size

    def shard_rows(self, shard: str) -> slice:
        if shard not in self._offsets:
            raise ValueError(f"shard={shard!r} is not one of {list(self._offsets)}")
        start = self._offsets[shard]
        return slice(start, start + self.shard_sizes[shard])

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> None:
        """Copy a checkpoint tensor into `param_name` ("weight", "bias", ...) rows of `shard`."""
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{param_name!r} is not a parameter of this layer (bias={self.bias is not None})")
        target = param.data[self.shard_rows(shard)]
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard!r} of {param_name}: checkpoint shape {tuple(loaded.shape)} does not match the "
                f"expected {tuple(target.shape)}; the config and the weights disagree"
            )
        target.copy_(loaded)


class PackedLinear(Linear, Packed):
    """Several projections of the same input stacked along the output dim, in `shards` order."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self._pack(shards)


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    return {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}


def gate_up_shards(intermediate_size: int) -> dict[str, int]:
    return {"gate": intermediate_size, "up": intermediate_size}
