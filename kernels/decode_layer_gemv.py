"""The persistent decode layer's projections (decode_layer_kernels.py): a program's share of one projection as
one loop over its (tile, K step) pairs, flattened, with the phase's epilogue at each tile's last step.

A program takes every program-th tile of BN output columns; a tile's K steps of BK columns follow each other.
With PRELOAD the weights are double-buffered in registers across the whole loop: step j + 1's weights are
asked for before step j's arithmetic, and step 0's before the grid barrier that precedes the phase
(`_load_step` there, handed in as `w0`), so the HBM streams while the program waits on the other programs;
without it, each step loads its own (Triton's pipeliner overlaps them when STAGES > 1). Device code only.
"""

from __future__ import annotations

import triton
import triton.language as tl

EPI_STORE = tl.constexpr(0)  # out[rows, N] = the product (qkv, down)
EPI_RESIDUAL = tl.constexpr(1)  # out = the product rounded + (x + residual) (o_proj: the residual stream h1)
EPI_SILU_MUL = tl.constexpr(2)  # gate and up tiles paired: out = silu(gate) * up (gate_up)


@triton.jit
def _inv_rms(x_ptr, res_ptr, rows, offs_r, K, eps, ADD: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    """[BLOCK_R] 1 / sqrt(mean(h^2) + eps) of each row's h = x (+ residual, rounded to x's dtype), rows of K."""
    acc = tl.zeros((BLOCK_R, CHUNK), dtype=tl.float32)
    r_mask = (offs_r < rows)[:, None]
    for start in range(0, K, CHUNK):
        at = offs_r[:, None] * K + start + tl.arange(0, CHUNK)[None, :]
        h = tl.load(x_ptr + at, mask=r_mask, other=0.0, cache_modifier=".cg")
        if ADD:
            res = tl.load(res_ptr + at, mask=r_mask, other=0.0, cache_modifier=".cg")
            h = (h.to(tl.float32) + res.to(tl.float32)).to(h.dtype)
        hf = h.to(tl.float32)
        acc += hf * hf
    return tl.math.rsqrt(tl.sum(acc, axis=1) / K + eps)


@triton.jit
def _acts(x_ptr, res_ptr, nw_ptr, rows, offs_r, offs_k, K, rms, ADD: tl.constexpr, NORM: tl.constexpr):
    """[BLOCK_R, BK] activations in x's dtype: x (+ residual) at columns offs_k, RMSNormed with `rms` as
    rms_norm_ref rounds (normed rounded, times the weight rounded) when NORM."""
    at = offs_r[:, None] * K + offs_k[None, :]
    r_mask = (offs_r < rows)[:, None]
    x = tl.load(x_ptr + at, mask=r_mask, other=0.0, cache_modifier=".cg")
    dtype = x.dtype
    if ADD:
        res = tl.load(res_ptr + at, mask=r_mask, other=0.0, cache_modifier=".cg")
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
    if NORM:
        w = tl.load(nw_ptr + offs_k)[None, :].to(tl.float32)
        x = (w * (x.to(tl.float32) * rms[:, None]).to(dtype).to(tl.float32)).to(dtype)
    return x


@triton.jit
def _dot_rows(acc, w, a, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_R, BN] + a [BLOCK_R, BK] x w [BN, BK]^T: one row on the CUDA cores, more through one
    tensor-core dot that shares the weight tile between them."""
    if BLOCK_R == 1:
        return acc + tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
    return acc + tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)


@triton.jit
def _store_rows(ptr, N, offs_r, rows, offs_n, value):
    tl.store(ptr + offs_r[:, None] * N + offs_n[None, :], value.to(ptr.dtype.element_ty), mask=(offs_r < rows)[:, None])


@triton.jit
def _num_steps(N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """This program's (tile, K step) pairs: its tiles (every program-th of N // BN) times K // BK."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    return tl.cdiv(tl.maximum(N // BN - pid, 0), programs) * (K // BK)


@triton.jit
def _load_step(w_ptr, j, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PAIR: tl.constexpr):
    """([BN, BK], [BN, BK]): the weights of this program's step j (W [N (x2 with PAIR: gate, then up), K]
    row-major); with PAIR the up rows beside the gate rows, else the first again. Past its last step: nothing
    read (the values undefined: never used)."""
    S: tl.constexpr = K // BK
    pid, programs = tl.program_id(0), tl.num_programs(0)
    tile = pid + (j // S) * programs
    rows = (tile * BN + tl.arange(0, BN)).to(tl.int64)
    cols = (j % S) * BK + tl.arange(0, BK)
    mask = (cols[None, :] * 0 + j) < _num_steps(N, K, BN, BK)  # a block: the interpreter takes no scalar mask
    # No `other`: past the last step nothing is read, and a fill value would make the compiler copy the loaded
    # registers (waiting for the loads) before the barrier's spin, where the preload should still be in flight.
    w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask)
    w2 = w
    if PAIR:
        w2 = tl.load(w_ptr + (rows + N)[:, None] * K + cols[None, :], mask=mask)
    return w, w2


@triton.jit
def _epilogue(
    acc, acc2, tile, out_ptr, x_ptr, res_ptr, rows, offs_r,
    N: tl.constexpr, EPI: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """A finished tile's outputs stored as the model's separate kernels round them."""
    offs_n = tile * BN + tl.arange(0, BN)
    dtype = out_ptr.dtype.element_ty
    if EPI == EPI_RESIDUAL:
        h0 = _acts(x_ptr, res_ptr, x_ptr, rows, offs_r, offs_n, N, offs_r, HAS_RESIDUAL, False)
        out = (acc.to(dtype).to(tl.float32) + h0.to(tl.float32)).to(dtype)  # torch's `o + h0`
    elif EPI == EPI_SILU_MUL:
        g = acc.to(dtype).to(tl.float32)  # silu_mul.py's roundings: silu in float32 rounded, the product rounded
        out = (tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dtype).to(tl.float32) * acc2.to(dtype).to(tl.float32)).to(dtype)
    else:
        out = acc
    _store_rows(out_ptr, N, offs_r, rows, offs_n, out)


@triton.jit
def _gemv_phase(
    w_ptr, w0, w20, in_ptr, in_res_ptr, nw_ptr, rms, out_ptr, x_ptr, res_ptr, rows, offs_r,
    N: tl.constexpr, K: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, EPI: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, PRELOAD: tl.constexpr,
):  # fmt: skip
    """This program's share of out = epilogue(activations x W^T): the activations are in_ptr's rows (+ in_res_ptr
    with ADD, RMSNormed by nw_ptr and `rms` with NORM); w0, w20: `_load_step(..., 0, ...)` with PRELOAD (else
    unread). The epilogue reads x_ptr and res_ptr (EPI_RESIDUAL)."""
    S: tl.constexpr = K // BK
    PAIR: tl.constexpr = EPI == EPI_SILU_MUL
    pid, programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros((BLOCK_R, BN), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, BN), dtype=tl.float32)
    w, w2 = w0, w20  # loop-carried with PRELOAD only
    if S == 1:  # one step a tile: every tile shares the activations, loaded once
        a = _acts(in_ptr, in_res_ptr, nw_ptr, rows, offs_r, tl.arange(0, BK), K, rms, ADD, NORM)
    for j in tl.range(0, _num_steps(N, K, BN, BK), num_stages=STAGES):
        if PRELOAD:
            w_next, w2_next = _load_step(w_ptr, j + 1, N, K, BN, BK, PAIR)  # in flight during this step
            wj, w2j = w, w2
        else:
            wj, w2j = _load_step(w_ptr, j, N, K, BN, BK, PAIR)
        if S > 1:  # this K step's activations
            a = _acts(in_ptr, in_res_ptr, nw_ptr, rows, offs_r, (j % S) * BK + tl.arange(0, BK), K, rms, ADD, NORM)
        acc = _dot_rows(acc, wj, a, BLOCK_R, DOT_PRECISION)
        if PAIR:
            acc2 = _dot_rows(acc2, w2j, a, BLOCK_R, DOT_PRECISION)
        if j % S == S - 1:
            _epilogue(acc, acc2, pid + (j // S) * programs, out_ptr, x_ptr, res_ptr, rows, offs_r, N, EPI,
                      HAS_RESIDUAL, BN)  # fmt: skip
            acc = tl.zeros((BLOCK_R, BN), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_R, BN), dtype=tl.float32)
        if PRELOAD:
            w, w2 = w_next, w2_next
