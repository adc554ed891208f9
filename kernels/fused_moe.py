"""The experts of a sparse mixture-of-experts MLP in Triton: routed rows grouped by expert, then two grouped
GEMMs over the groups (gate/up with SiLU-and-mul fused, down with the routing weight applied) and the sum over
each token's top k.

`experts_ref` (moe_ref.py) is the specification of `fused_moe`, `align_ref` of `moe_align`. Four launches and
a sum: two to group the rows (`_count_kernel`: each program counts its slice of the routed rows per expert;
`_scatter_kernel`: each program places its rows after the earlier programs' in their expert's group, pads the
groups to whole blocks and names each block's expert), one per GEMM. Every shape, grid and buffer depends on
the token count, top k and expert count only, never on the routing: nothing syncs with the host and the launch
can be captured in a CUDA graph; blocks past the last one used return at once. Knows nothing of models.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_ref import align_ref, experts_ref, padded_capacity

__all__ = ["DTYPES", "align_ref", "block_m_for", "experts_ref", "fused_moe", "moe_align"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ALIGN_PROGRAMS = 256  # at most: each grouping program reads every program's counts
_ALIGN_MIN_CHUNK = 256  # routed rows per grouping program, at least
_ONE_HOT = 4096  # elements of a grouping program's [rows, experts] one-hot tile


# Sizes that change with the token count are plain arguments (not specialised on), so the kernels compile once
# per model, dtype and BLOCK_M whatever the batch: no compile in the middle of serving.
@triton.jit(do_not_specialize=["num_slots", "chunk"])
def _count_kernel(ids_ptr, counts_ptr, num_slots, chunk, SUB: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[p, e]: how many of program p's `chunk` routed rows go to expert e."""
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, chunk, SUB):
        slots = pid * chunk + start + tl.arange(0, SUB)
        e = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32)
        acc += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid * BLOCK_E + experts, acc)


@triton.jit(do_not_specialize=["num_slots", "num_programs", "num_blocks", "chunk"])
def _scatter_kernel(
    ids_ptr, counts_ptr, sorted_ptr, block_experts_ptr, num_rows_ptr, num_slots, num_programs, num_blocks, chunk,
    SUB: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)  # rows per expert
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # rows per expert in earlier programs' slices
    for q in range(0, num_programs):
        c = tl.load(counts_ptr + q * BLOCK_E + experts)
        total += c
        before += tl.where(q < pid, c, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded  # each expert's first row; empty experts take no room
    next_row = starts + before  # where this program's next row of each expert goes
    for start in range(0, chunk, SUB):
        slots = pid * chunk + start + tl.arange(0, SUB)
        valid = slots < num_slots
        e = tl.load(ids_ptr + slots, mask=valid, other=-1).to(tl.int32)
        one_hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [SUB, BLOCK_E]
        earlier = tl.cumsum(one_hot, axis=0) - one_hot  # rows of the same expert above, in this sub-slice
        dest = tl.sum((earlier + next_row[None, :]) * one_hot, axis=1)  # [SUB]
        tl.store(sorted_ptr + dest, slots, mask=valid)
        next_row += tl.sum(one_hot, axis=0)
    if pid == 0:
        tl.store(num_rows_ptr, tl.sum(padded, axis=0))
    # Blocks pid, pid + P, ...: each block's expert, and "no row" in its padding (disjoint from the rows above).
    in_block = tl.arange(0, BLOCK_M)
    for block in range(pid, num_blocks, num_programs):
        first = block * BLOCK_M
        owner = (starts <= first) & (first < ends)  # [BLOCK_E]: one expert, or none past the last block used
        used = tl.sum(owner.to(tl.int32), axis=0)
        expert = tl.sum(tl.where(owner, experts, 0), axis=0)
        begin = tl.sum(tl.where(owner, starts, 0), axis=0)
        count = tl.sum(tl.where(owner, total, 0), axis=0)  # 0 when unused: the whole block is padding
        tl.store(block_experts_ptr + block, tl.where(used > 0, expert, -1))
        rows = first + in_block
        tl.store(sorted_ptr + rows, tl.zeros([BLOCK_M], dtype=tl.int32) + num_slots, mask=rows - begin >= count)


@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_experts_ptr, num_slots, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_ot,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[s, n] = silu(x[t] . w[e, n]) * (x[t] . w[e, I + n]) for the rows s = t * K + k of one block of one
    expert e, columns n of one tile; each product rounded to the output dtype as torch rounds F.linear."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(inter, BLOCK_N)
    block, tile = pid // num_n, pid % num_n
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    rows = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [M] routed rows, num_slots: none
    row_ok = rows < num_slots
    token = (rows // TOP_K).to(tl.int64)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        a = tl.load(
            x_ptr + token[:, None] * stride_xt + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = k_ok[:, None] & n_ok[None, :]
        g = tl.load(w_expert + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)  # [K, N]
        u = tl.load(w_expert + (inter + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        acc_gate += tl.dot(a, g, input_precision=DOT_PRECISION)
        acc_up += tl.dot(a, u, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    # silu_and_mul_ref's roundings: silu in float32 with IEEE division, rounded, then the product rounded.
    act = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    out = (act * up).to(dtype)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, out, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    h_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, block_experts_ptr, num_slots, hidden, inter,
    stride_ht, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[s, n] = round(h[s] . w[e, n]) * weights[s] for the rows s of one block of one expert e."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(hidden, BLOCK_N)
    block, tile = pid // num_n, pid % num_n
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    rows = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_slots
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_ht
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(h_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            w_expert + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0
        )
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # [M]
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, out, mask=row_ok[:, None] & n_ok[None, :])


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows per GEMM block: 16 while experts get about 16 rows or fewer each (decode), else 64."""
    return 16 if num_slots <= 16 * num_experts else 64


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_ref`'s three tensors, computed on the device in two launches (see the module docstring)."""
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
        raise ValueError(f"ids must be a contiguous [T, K] int32/int64 tensor; got {ids.dtype} {tuple(ids.shape)}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= 16")
    num_slots = ids.numel()
    capacity = padded_capacity(num_slots, num_experts, block_m)
    device = ids.device
    sorted_slots = torch.empty(capacity, dtype=torch.int32, device=device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    if num_slots == 0:
        return sorted_slots, block_experts, torch.zeros(1, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int32, device=device)  # program 0 of the scatter writes it
    block_e = max(16, triton.next_power_of_2(num_experts))
    chunk = max(_ALIGN_MIN_CHUNK, triton.next_power_of_2(triton.cdiv(num_slots, _ALIGN_PROGRAMS)))
    sub = max(16, _ONE_HOT // block_e)  # divides chunk: both powers of two, sub <= 256 <= chunk
    programs = triton.cdiv(num_slots, chunk)
    counts = torch.empty(programs, block_e, dtype=torch.int32, device=device)
    _count_kernel[(programs,)](ids, counts, num_slots, chunk, SUB=sub, BLOCK_E=block_e)
    _scatter_kernel[(programs,)](
        ids, counts, sorted_slots, block_experts, num_rows, num_slots, programs, capacity // block_m, chunk,
        SUB=sub, BLOCK_E=block_e, BLOCK_M=block_m,
    )  # fmt: skip
    return sorted_slots, block_experts, num_rows


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] with contiguous rows; got shape {tuple(x.shape)}, strides {x.stride()}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected one of float32, float16, bfloat16")
    hidden = x.shape[1]
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2 * I, H={hidden}]; got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must be [E, H, I] = {(num_experts, hidden, inter)}; got {tuple(w2.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype}; expected x's dtype {x.dtype}")
        if not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(
            f"weights and ids must both be [T={x.shape[0]}, K]; got {tuple(weights.shape)} and {tuple(ids.shape)}"
        )
    if not weights.is_contiguous() or not weights.is_floating_point():
        raise ValueError(f"weights must be a contiguous float tensor; got {weights.dtype}")
    for name, t in (("w13", w13), ("w2", w2), ("weights", weights), ("ids", ids)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: all must share one device")


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K]: routing weights
    ids: torch.Tensor,  # [T, K]: expert ids, int64 (torch.topk's) or int32
) -> torch.Tensor:  # [T, H], x's dtype
    """`experts_ref` on the device, with float32 accumulation; float32, float16 or bfloat16."""
    _check(x, w13, w2, weights, ids)
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    block_m = block_m_for(num_slots, num_experts)
    sorted_slots, block_experts, _ = moe_align(ids.contiguous(), num_experts, block_m)
    num_blocks = block_experts.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # no TF32 rounding for float32 inputs
    block_k = 32 if x.dtype == torch.float32 else 64
    block_n = 64
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)  # [T * K, I]
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, block_n),)](
        x, w13, h, sorted_slots, block_experts, num_slots, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
    )  # fmt: skip
    out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)  # [T * K, H]
    _down_kernel[(num_blocks * triton.cdiv(hidden, block_n),)](
        h, w2, weights, out, sorted_slots, block_experts, num_slots, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
    )  # fmt: skip
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
