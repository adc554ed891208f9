"""The decode reduce folded into the split kernel (`_decode_split_kernel` with FOLD): a multi-split decode step
in one launch. Each live split of a (work entry, KV head) writes its partial as for the reduce kernel, then
draws a ticket from the pair's counter; the program that draws the last merges every live partial by their
log-sum-exp with `_decode_reduce_kernel`'s arithmetic, writes the normalised output and puts the counter back
to 0, so the next launch (a later layer, a graph's replay) starts clean. Knows the partials' layout and the
counters' contract, not how a split walks its keys.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fold_is_last(counter_ptr, live):
    """Takes this program's ticket on `counter_ptr` (int32) and returns whether it is the last of `live`.

    Why the last program sees every partial: each program's threads store their share of its partial, then
    the barrier orders those stores before its one atomic (Triton issues a scalar atomic from one thread), and
    that atomic's release at GPU scope (acq_rel, what tl.atomic_add defaults to; spelled out here) is
    cumulative, so it publishes the whole program's stores. The atomics on one address form a single order:
    the program that reads live - 1 comes after every other program's release, and its acquire (the same
    acq_rel atomic) orders its reads after them; its other threads learn the ticket from that thread through
    shared memory behind a barrier, so their loads come after the acquire too. The merge also loads with
    .cg (L2, where every SM's stores meet), so no line this SM's L1 cached earlier in the launch is reread.
    The interpreter runs programs one at a time and cannot catch an ordering bug: tests/gpu does, with many
    splits and rows."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == live - 1


@triton.jit
def _fold_merge(
    dst, counter_ptr, acc_ptr, m_ptr, l_ptr, part0, live, offs_d, g_mask, d_mask,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The last program's merge of one row's `live` partials (heads `part0` [G]: each head's first partial
    slot, its live splits following) into `dst` [G, D] (output pointers), then the counter reset."""
    offs_s = tl.arange(0, BLOCK_S)
    mask = g_mask[:, None] & (offs_s < live)[None, :]
    m = tl.load(m_ptr + part0[:, None] + offs_s[None, :], mask=mask, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(l_ptr + part0[:, None] + offs_s[None, :], mask=mask, other=0.0, cache_modifier=".cg")  # [G, S]
    # Live splits hold keys, so each real head's max is finite; padded heads (never stored) take 0, not NaN.
    m_max = tl.where(g_mask, tl.max(m, axis=1), 0.0)
    weight = tl.exp2(m - m_max[:, None])  # [G, S]
    den = tl.where(g_mask, tl.sum(l_s * weight, axis=1), 1.0)  # padded heads: 0 / 1, never stored
    num = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    acc_mask = g_mask[:, None] & d_mask[None, :]
    for s in range(0, live):
        w = tl.sum(tl.where(offs_s[None, :] == s, weight, 0.0), axis=1)  # column s of weight: [G]
        part = (part0 + s)[:, None] * HEAD_DIM + offs_d[None, :]
        num += tl.load(acc_ptr + part, mask=acc_mask, other=0.0, cache_modifier=".cg") * w[:, None]
    out = num / den[:, None]
    tl.store(dst, out.to(dst.dtype.element_ty), mask=acc_mask)
    tl.store(counter_ptr, 0)  # every other live program has drawn its ticket: nothing else touches it now
