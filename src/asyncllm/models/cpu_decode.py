"""The Llama family's decode step on a CPU in few ops: what `LlamaForCausalLM.forward` computes for steps where
every sequence decodes one token at the same length, without its module calls and dtype round trips.

On a CPU each torch op costs microseconds whatever its size, and a small model's decode step is mostly small
ops (SmolLM2: 30 layers of ~70 ops plus ~20 module calls each). This path walks the same weights with ~40 ops a
layer: RMSNorm without its identity casts, rotary over q and k at once (`x * cos2 + roll(x) * sin2`, the
reference's sums bit for bit), the cache written and read with one op each per tensor
(attention/cpu_decode.py), and a packed int4 layer's bfloat16 output handed on as it is (the next op promotes it
to float32 exactly as the reference's explicit cast does). In float32 only attention's summation order differs
from the module path, its twin (ASYNCLLM_CPU_DECODE=off); tests/models/test_cpu_decode.py holds the two together.
Where every projection is packed int4 and the C ops built (`build(model, native)`), a layer's small ops run in C
instead (cpu_decode_native.py; this file's torch loop is then its twin, ASYNCLLM_CPU_NATIVE=off).

Installed from outside (`install`) on a loaded float32 model whose every layer it understands; any other step
(prompt chunks, mixed lengths, a LoRA batch) returns None and the modules run. Knows no engine or scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.cpu_decode import (
    attend_keys,
    decode_blocks,
    paged_decode_attention,
    stacked_caches,
    step_keys,
)
from asyncllm.attention.layer import KVCache
from asyncllm.kernels.cpu_decode_native import CpuDecodeOps
from asyncllm.layers.activation import SiluAndMul
from asyncllm.layers.linear import Linear, PackedLinear
from asyncllm.layers.norm import RMSNorm
from asyncllm.models.cpu_decode_native import NativeDecode, NativeLayer
from asyncllm.quantization import cpu_int4
from asyncllm.quantization.linear import PackedQuantLinear, QuantLinear

_INT4_INPUT = torch.bfloat16


@dataclass(frozen=True)
class _Proj:
    """One projection: torch's int4 kernel on the packed weight (a bfloat16 result, or float32 with a bias), or
    the module itself (a float weight: its own F.linear)."""

    module: nn.Module
    int4: cpu_int4.Int4Weight | None = None
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.int4
        if w is None:
            return self.module(x)  # type: ignore[no-any-return]
        xb = x if x.dtype == _INT4_INPUT else x.to(_INT4_INPUT)
        if w.planes == 2:
            xb = torch.cat((xb, xb), dim=1)  # each input meets its high and its low code plane
        if x.shape[0] > cpu_int4.INT4_MAX_ROWS:
            y = F.linear(xb, cpu_int4.dequantize(w))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.packed, w.group_size, w.scale_zeros)
        return y if self.bias is None else y + self.bias  # the sum promotes to the bias's float32


def _mul_into(proj: _Proj, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b, computed in float32 and, for an int4 projection, stored in bfloat16 as it is made (one rounding
    of the float32 product, as the reference's cast after it: one op fewer)."""
    if proj.int4 is None:
        return a * b
    shape = b.shape if b.dim() > a.dim() else a.shape  # a norm's weight [K] against rows [T, K]; else equal
    return torch.mul(a, b, out=torch.empty(shape, dtype=_INT4_INPUT))


def _proj(module: nn.Module) -> _Proj | None:
    if type(module) in (QuantLinear, PackedQuantLinear):
        assert isinstance(module, QuantLinear)
        weight = module._cpu_weight
        if module.group is not None or weight is None:
            return None  # row-parallel (an all-reduce), or the reference's quantized matmul
        return _Proj(module, weight, module.bias) if isinstance(weight, cpu_int4.Int4Weight) else _Proj(module)
    if type(module) in (Linear, PackedLinear):
        return _Proj(module)
    return None  # LoRA-wrapped, tensor-parallel: the modules' own path


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: _Proj
    o: _Proj
    mlp_norm: torch.Tensor
    gate_up: _Proj
    down: _Proj
    scale: float


class CpuDecode:
    """`__call__(input_ids, positions, kv_caches, meta)`: the final-normed hidden states [T, hidden] of a
    decode step this path takes, else None."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[_Layer],
        owners: list[tuple[nn.Module, str, nn.Module]],
        native: NativeDecode | None = None,
    ) -> None:
        arch = model.arch  # type: ignore[union-attr]
        self.model = model
        self.layers = layers
        self.native = native  # the layers' small ops in C (cpu_decode_native.py), where they are all int4
        self._owners = owners  # (parent, attribute, module) the layers were read from: a swap (LoRA) turns it off
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        # The steps' cache list (the runner's, the same every step), its layers as one view (`stacked_caches`; None
        # where they are not one storage) and each layer's caches as rows by slot: made at the first step.
        self._stacked: tuple[list[KVCache], torch.Tensor | None, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def _still_ours(self) -> bool:
        return all(getattr(parent, attr) is module for parent, attr, module in self._owners)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor, into: _Proj | None = None) -> torch.Tensor:
        """rms_norm_ref for float32 rows in one call of torch's `rms_norm` (on CPU the reference's five ops in one
        call from Python: tests hold the two paths together); for an int4 projection `into`, rounded to its
        bfloat16 input as the reference's cast does."""
        normed = F.rms_norm(h, (h.shape[-1],), weight, self.eps)
        return normed if into is None or into.int4 is None else normed.to(_INT4_INPUT)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor | None:
        seq_lens = meta.seq_lens_cpu
        num_tokens = input_ids.shape[0]
        if meta.max_query_len != 1 or num_tokens != len(seq_lens) or min(seq_lens) != meta.max_seq_len:
            return None  # prompt rows, padding or unequal lengths: the reference's masks are needed
        k0 = kv_caches[0][0]
        model = self.model
        if k0.dtype != torch.float32 or model.model.norm.fused or not self._still_ours():  # type: ignore[union-attr]
            return None  # an FP8 cache, the fused kernels on (Triton), a module swapped since: the modules' path
        rotary = model.rotary_emb  # type: ignore[union-attr]
        h_q, h_kv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        seq_len = meta.max_seq_len
        cos, sin = rotary.cos_cache[positions], rotary.sin_cache[positions]  # [T, D/2]
        if self.native is not None:
            x = model.model.embed_tokens(input_ids).contiguous()  # type: ignore[union-attr]
            out = self.native(x, cos, sin, meta.slot_mapping, kv_caches, meta.block_tables, seq_len)
            if out is not None:
                return out
        blocks = decode_blocks(meta.block_tables, seq_len, k0.shape[1])
        if self._stacked is None or self._stacked[0] is not kv_caches:  # the same list every step: made once
            flat = [(k.view(-1, h_kv, dim), v.view(-1, h_kv, dim)) for k, v in kv_caches]  # rows by slot
            self._stacked = (kv_caches, stacked_caches(kv_caches), flat)
        _, stacked, flat = self._stacked
        keys = None if stacked is None else step_keys(stacked, blocks, num_tokens, seq_len)  # None: by each layer
        slots = meta.slot_mapping
        cos2 = torch.cat((cos, cos), dim=-1)[:, None, :]  # [T, 1, D]
        sin2 = torch.cat((-sin, sin), dim=-1)[:, None, :]  # x1 c + x2 (-s) is x1 c - x2 s exactly
        x = model.model.embed_tokens(input_ids)  # type: ignore[union-attr]
        residual: torch.Tensor | None = None
        qk_rows = (h_q + h_kv) * dim
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            residual = x if residual is None else x + residual  # a bfloat16 x promotes exactly
            qkv = layer.qkv(self._norm(residual, layer.attn_norm, layer.qkv)).float()  # [T, (H + 2 Hkv) D]
            qk = qkv[:, :qk_rows].view(num_tokens, h_q + h_kv, dim)
            qk = qk * cos2 + qk.roll(dim // 2, dims=-1) * sin2  # rotate-half: [x2, x1] against [-s, s]
            k_new, v_new = qk[:, h_q:], qkv[:, qk_rows:].view(num_tokens, h_kv, dim)
            k_rows, v_rows = flat[i]
            k_rows.index_copy_(0, slots, k_new)
            v_rows.index_copy_(0, slots, v_new)
            if keys is not None:
                keys.write(i, k_new, v_new)
                out = attend_keys(qk[:, :h_q], keys.kv[2 * i], keys.kv[2 * i + 1], layer.scale)
            else:
                out = paged_decode_attention(qk[:, :h_q], k_cache, v_cache, blocks, seq_len, layer.scale)
            residual = layer.o(out) + residual
            gate_up = layer.gate_up(self._norm(residual, layer.mlp_norm, layer.gate_up))  # [T, 2I]
            gate, up = gate_up.chunk(2, dim=-1)
            x = layer.down(_mul_into(layer.down, F.silu(gate.float()), up))  # silu in float32, up promoted
        assert residual is not None
        return self._norm(x + residual, model.model.norm.weight)  # type: ignore[union-attr]


def build(model: nn.Module, native: Callable[[], CpuDecodeOps | None] | None = None) -> CpuDecode | None:
    """The path for a loaded model, or None where some layer is not the plain Llama maths it reproduces (a
    q/k norm, Gemma's norms, sliding windows, MoE, another activation, a projection it cannot call directly).
    With `native` (what gives the compiled ops, called only for a model they fit), layers whose projections are
    all packed int4 run their small ops in C."""
    from asyncllm.attention.torch_ref import TorchAttentionBackend
    from asyncllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

    if not isinstance(model, LlamaForCausalLM) or model.embed_scale is not None:
        return None
    if next(model.parameters()).dtype != torch.float32 or type(model.model.norm) is not RMSNorm:
        return None
    layers: list[_Layer] = []
    owners: list[tuple[nn.Module, str, nn.Module]] = []
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP or type(mlp.act) is not SiluAndMul:
            return None
        if attn.fused or attn.attn.window is not None or type(attn.attn.backend) is not TorchAttentionBackend:
            return None
        norms = (block.input_layernorm, block.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.fused or n.eps != model.arch.rms_norm_eps for n in norms):
            return None
        pairs = [(attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")]
        projs = [_proj(getattr(p, a)) for p, a in pairs]
        if any(p is None for p in projs):
            return None
        owners += [(parent, attr, getattr(parent, attr)) for parent, attr in pairs]
        qkv, o, gate_up, down = projs
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        layers.append(_Layer(norms[0].weight, qkv, o, norms[1].weight, gate_up, down, attn.attn.scale))
    arch = model.arch
    heads = (arch.num_heads, arch.num_kv_heads, arch.head_dim)
    fast = None if native is None else _native(native, layers, model.model.norm.weight, heads, arch.rms_norm_eps)
    return CpuDecode(model, layers, owners, fast)


def _native(
    ops_for: Callable[[], CpuDecodeOps | None],
    layers: list[_Layer],
    final_norm: torch.Tensor,
    heads: tuple[int, int, int],
    eps: float,
) -> NativeDecode | None:
    """The C path over these layers, where every projection is packed int4 and only q/k/v carry a bias."""
    native: list[NativeLayer] = []
    for layer in layers:
        qkv, o, gate_up, down = (p.int4 for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        if any(p.bias is not None for p in (layer.o, layer.gate_up, layer.down)):
            return None
        bias = layer.qkv.bias
        native.append(NativeLayer(layer.attn_norm, qkv, bias, o, layer.mlp_norm, gate_up, down, layer.scale))
    ops = ops_for()  # compiled (once per machine) only now that the model is known to fit
    return None if ops is None else NativeDecode.build(ops, native, final_norm, heads, eps)
