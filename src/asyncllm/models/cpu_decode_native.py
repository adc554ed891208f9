"""The CPU decode path's layers with their small ops in C (kernels/cpu_decode_ops.c): per layer torch's four int4
GEMVs and four calls, add-and-norm, rotary-and-cache-write, attention over the paged cache, SiLU-and-multiply,
where torch's eager ops take ~25 (each paying a dispatch that the GEMV before it evicted from the caches).

Taken by models/cpu_decode.py for models whose four projections a layer are all packed int4 (bias on q/k/v only),
for decode steps of up to `INT4_MAX_ROWS` rows; its torch loop is the twin (ASYNCLLM_CPU_NATIVE=off). Buffers
are made once per row count and reused: a step reads them before the next one writes. Knows no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.kernels.cpu_decode_native import BF16, F32, CpuDecodeOps, attention_scratch
from asyncllm.quantization import cpu_int4

_mm = torch.ops.aten._weight_int4pack_mm_for_cpu


@dataclass(frozen=True)
class NativeLayer:
    attn_norm: torch.Tensor  # [hidden] float32
    qkv: cpu_int4.Int4Weight
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D] float32
    o: cpu_int4.Int4Weight
    mlp_norm: torch.Tensor
    gate_up: cpu_int4.Int4Weight
    down: cpu_int4.Int4Weight
    scale: float


class _Buffers:
    """One row count's activations: the residual stream, each projection's bfloat16 input (laid out in its
    planes) and the rotated queries."""

    def __init__(self, rows: int, layer: NativeLayer, hidden: int, q_shape: tuple[int, int]) -> None:
        def planes(w: cpu_int4.Int4Weight) -> torch.Tensor:
            return torch.empty(rows, w.planes * w.in_features, dtype=torch.bfloat16)

        self.residual = torch.empty(rows, hidden, dtype=torch.float32)  # the C code's types, whatever the default
        self.qkv_in, self.o_in, self.gate_up_in, self.down_in = (
            planes(layer.qkv), planes(layer.o), planes(layer.gate_up), planes(layer.down)
        )  # fmt: skip
        self.q = torch.empty(rows, *q_shape, dtype=torch.float32)


class NativeDecode:
    """`__call__`: the final-normed hidden states [T, hidden] float32 of a decode step, every row at `seq_len`."""

    def __init__(
        self, ops: CpuDecodeOps, layers: list[NativeLayer], final_norm: torch.Tensor, heads: tuple[int, int, int],
        eps: float,
    ) -> None:  # fmt: skip
        self.lib = ops.lib
        self.layers = layers
        self.final_norm = final_norm
        self.num_heads, self.num_kv_heads, self.head_dim = heads
        self.eps = eps
        self.hidden = final_norm.shape[0]
        self.inter = layers[0].down.in_features
        self._buffers: dict[int, _Buffers] = {}
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the step's cache list, once checked
        self._scratch = torch.empty(0, dtype=torch.float32)  # attention's, grown to the longest sequence yet

    def _caches_fit(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Every layer's caches float32, contiguous, [num_blocks, block_size, Hkv, D] alike."""
        shape = kv_caches[0][0].shape
        if (
            len(kv_caches) != len(self.layers)
            or len(shape) != 4
            or tuple(shape[2:]) != (self.num_kv_heads, self.head_dim)
        ):
            return False
        return all(
            c.is_contiguous() and c.dtype == torch.float32 and c.shape == shape for pair in kv_caches for c in pair
        )

    @staticmethod
    def build(ops: CpuDecodeOps, layers: list[NativeLayer], final_norm: torch.Tensor, heads: tuple[int, int, int],
              eps: float) -> NativeDecode | None:  # fmt: skip
        """The path, or None where the layers differ in shape or planes (one set of buffers serves them all)."""
        first = layers[0]
        shapes = {(ly.qkv.planes, ly.o.planes, ly.gate_up.planes, ly.down.planes, ly.down.in_features) for ly in layers}
        if len(shapes) != 1 or first.gate_up.out_features != 2 * first.down.in_features:
            return None
        tensors = [final_norm] + [t for ly in layers for t in (ly.attn_norm, ly.mlp_norm, ly.qkv_bias) if t is not None]
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            return None
        return NativeDecode(ops, layers, final_norm, heads, eps)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] float32: the tokens' embeddings
        cos: torch.Tensor,  # [T, D / 2] float32, contiguous
        sin: torch.Tensor,
        slots: torch.Tensor,  # [T] int64: each new token's cache row
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [num_blocks, block_size, Hkv, D] float32
        block_tables: torch.Tensor,  # [>= T, max_blocks] int32, contiguous rows
        seq_len: int,
    ) -> torch.Tensor | None:
        rows = x.shape[0]
        if rows > cpu_int4.INT4_MAX_ROWS or 2 * cos.shape[-1] != self.head_dim:
            return None  # past the GEMV's rows the torch loop's dense path is faster; a partial rotary
        if kv_caches is not self._caches:  # the runner's list, the same every step: checked once
            if not self._caches_fit(kv_caches):
                return None
            self._caches = kv_caches
        k0 = kv_caches[0][0]
        num_blocks, block_size = k0.shape[:2]
        needed = -(-seq_len // block_size)
        # What the C code reads as raw memory: the types and shapes it assumes, checked once a step.
        if x.dtype != torch.float32 or slots.dtype != torch.int64 or block_tables.dtype != torch.int32:
            return None
        if block_tables.stride(1) != 1 or block_tables.shape[0] < rows or block_tables.shape[1] < needed:
            return None
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or slots.shape != (rows,):
            return None
        if not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and slots.is_contiguous()):
            return None
        # The C code writes and reads where these say: check them once a step, not trust them.
        low, high = slots.aminmax()
        first, last = block_tables[:rows, :needed].aminmax()
        if int(low) < 0:
            return None  # a row that writes no KV (a padded one): the torch loop's indexing
        if int(high) >= num_blocks * block_size or int(last) >= num_blocks or int(first) < 0:
            raise IndexError(f"a decode step's slots or blocks lie outside the cache's {num_blocks} blocks")
        buf = self._buffers.get(rows)
        if buf is None:
            buf = self._buffers[rows] = _Buffers(rows, self.layers[0], self.hidden, (self.num_heads, self.head_dim))
        lib, eps, hidden, inter = self.lib, self.eps, self.hidden, self.inter
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        floats = attention_scratch(hq // hkv, seq_len, d)
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(2 * floats, dtype=torch.float32)
        scratch = self._scratch.data_ptr()
        res, q = buf.residual.data_ptr(), buf.q.data_ptr()
        qkv_in, o_in, gate_up_in, down_in = (t.data_ptr() for t in (buf.qkv_in, buf.o_in, buf.gate_up_in, buf.down_in))
        planes = (buf.qkv_in.shape[1] // hidden, buf.o_in.shape[1] // (hq * d), buf.gate_up_in.shape[1] // hidden,
                  buf.down_in.shape[1] // inter)  # fmt: skip
        cos_p, sin_p, slots_p = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        tables, table_stride = block_tables.data_ptr(), block_tables.stride(0)
        h, h_kind, add = x, F32, 0
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            # Pointers read each step, not kept: a weight's storage may be replaced after the path was built.
            attn_norm, mlp_norm = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr()
            qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
            lib.asl_add_rms_norm(h.data_ptr(), h_kind, add, res, attn_norm, eps, rows, hidden, qkv_in, planes[0])
            w = layer.qkv
            qkv = _mm(buf.qkv_in, w.packed, w.group_size, w.scale_zeros)  # [T, (Hq + 2 Hkv) D] bfloat16
            k_p, v_p = k_cache.data_ptr(), v_cache.data_ptr()
            lib.asl_rope_kv_write(qkv.data_ptr(), BF16, qkv_bias, rows, hq, hkv, d, cos_p, sin_p, slots_p, q, k_p, v_p)
            lib.asl_decode_attention(q, k_p, v_p, tables, table_stride, seq_len, block_size, rows, hq, hkv, d,
                                     layer.scale, o_in, planes[1], scratch)  # fmt: skip
            w = layer.o
            o = _mm(buf.o_in, w.packed, w.group_size, w.scale_zeros)  # [T, hidden]
            lib.asl_add_rms_norm(o.data_ptr(), BF16, 1, res, mlp_norm, eps, rows, hidden, gate_up_in, planes[2])
            w = layer.gate_up
            gate_up = _mm(buf.gate_up_in, w.packed, w.group_size, w.scale_zeros)  # [T, 2I]
            lib.asl_silu_mul(gate_up.data_ptr(), BF16, rows, inter, down_in, planes[3])
            w = layer.down
            h = _mm(buf.down_in, w.packed, w.group_size, w.scale_zeros)  # [T, hidden] bfloat16
            h_kind, add = BF16, 1
        out = torch.empty(rows, hidden, dtype=torch.float32)
        lib.asl_add_rms_norm(h.data_ptr(), h_kind, add, res, self.final_norm.data_ptr(), eps, rows, hidden,
                             out.data_ptr(), 0)  # fmt: skip
        return out
