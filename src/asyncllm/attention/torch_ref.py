"""Pure-PyTorch paged attention: the specification every faster backend is tested against.

Written for clarity over speed: gather each sequence's keys from its blocks, attend in float32, causal
within the sequence (query row j of a sequence of length L sits at position L - query_len + j) and, for a
sliding-window layer, within the window (transformers' `kv_idx > q_idx - window`). Decode-only sequences are
batched with padding so the reference stays usable as a GPU baseline. An FP8 cache's codes are read as
float32 numbers, code * scale (kernels/kv_cache_fp8_ref.py), before anything else touches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata, AttentionPlan, PlanBounds, store_kv
from asyncllm.kernels.kv_cache_fp8_ref import gather, read_kv

__all__ = ["TorchAttentionBackend", "attend", "gather_kv", "store_kv"]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, start: int = 0) -> torch.Tensor:
    """[seq_len - start, num_kv_heads, head_dim]: one sequence's cached rows `start..seq_len` in token order
    (the blocks before `start` are not read: a sliding window may have given them away)."""
    block_size = cache.shape[1]
    first, num_blocks = start // block_size, -(-seq_len // block_size)
    rows: torch.Tensor = gather(cache, block_table[first:num_blocks].long()).flatten(0, 1)
    return rows[start - first * block_size : seq_len - first * block_size]


# Scores held at once by `attend`, in elements: its query rows go in blocks of at most this many scores (4 MiB
# of float32). A 512-token prompt chunk of SmolLM2 would otherwise hold [9, 512, 512] scores and their softmax
# (18 MiB a layer): the largest temporaries of a CPU prompt step, kept by the allocator as resident memory.
_SCORES_AT_ONCE = 1 << 20


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_offset: int,
    window: int | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """q [Q, H, D], k/v [K, Hkv, D] -> [Q, H, D]; query j sits at position causal_offset + j and key i at
    key_start + i; a query sees the keys at or before its position (and, with a window, after position -
    window). float32 maths. Every query must see at least one key. Each query row's softmax is its own, so
    the rows are attended in blocks (`_SCORES_AT_ONCE`)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, K, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    rows = max(1, _SCORES_AT_ONCE // (num_heads * k.shape[0]))
    if q.shape[0] <= rows:
        return _attend_rows(q, kf, vf, scale, causal_offset, window, key_start)
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], rows):
        block = q[start : start + rows]
        out[start : start + rows] = _attend_rows(block, kf, vf, scale, causal_offset + start, window, key_start)
    return out


def _attend_rows(
    q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, scale: float, causal_offset: int, window: int | None,
    key_start: int,
) -> torch.Tensor:  # fmt: skip
    """`attend` for the query rows q [Q, H, D] against the keys and values as float32 [H, K, D]."""
    qf = q.float().transpose(0, 1)  # [H, Q, D]
    scores = torch.matmul(qf, kf.transpose(1, 2)).mul_(scale)  # [H, Q, K]; in place: one temporary fewer
    qpos = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
    kpos = torch.arange(kf.shape[1], device=q.device)[None, :] + key_start
    hidden = kpos > qpos
    if window is not None:
        hidden |= kpos <= qpos - window
    scores.masked_fill_(hidden, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [H, Q, D]
    return out.transpose(0, 1).to(q.dtype)


@dataclass
class _Plan(AttentionPlan):
    work: list[int]  # int64: the decode sequences' query rows, then their batch indices, then their key lengths
    starts: list[int]  # query row offsets, host side
    prefill_seqs: list[int]  # sequences with more than one query token: attended one by one
    decode_seqs: list[int]  # single-token sequences: batched with padding
    decode_max_len: int
    decode_min_len: int = 0
    decode_rows: torch.Tensor | None = None  # [B] int64 query row of each decode sequence (device, `bind`)
    decode_seq_idx: torch.Tensor | None = None  # [B] int64 their index in the batch (device)
    decode_lens: torch.Tensor | None = None  # [B] int64 their key lengths (device)
    # What every layer of the step would otherwise derive again: the block tables as indices, and per window
    # the keys each row may not see (None: it sees every gathered key). Made by the first layer that asks.
    decode_tables: torch.Tensor | None = None  # [B, blocks] int64
    hidden_keys: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # window -> [B, L] bool

    def bind(self, work: torch.Tensor) -> None:
        n = len(self.decode_seqs)
        if n:
            self.decode_rows, self.decode_seq_idx, self.decode_lens = work[:n], work[n : 2 * n], work[2 * n :]

    def hidden(self, window: int | None) -> torch.Tensor | None:
        """[B, L] bool, True where a decode row must not see the key: past its length (padding) or before its
        window; None where no row hides any (batch-1 decode of global attention: the masks would be no-ops)."""
        if window not in self.hidden_keys:
            assert self.decode_lens is not None
            cut = window is not None and self.decode_max_len > window
            mask = None
            if self.decode_min_len < self.decode_max_len or cut:
                pos = torch.arange(self.decode_max_len, device=self.decode_lens.device)[None, :]
                valid = pos < self.decode_lens[:, None]
                if window is not None:
                    valid &= pos >= self.decode_lens[:, None] - window
                mask = ~valid
            self.hidden_keys[window] = mask
        return self.hidden_keys[window]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    work_dtype = torch.int64

    def plan(self, meta: AttentionMetadata, bounds: PlanBounds | None = None, variant: int | None = None) -> _Plan:
        if bounds is not None:
            raise NotImplementedError("the 'torch' attention backend plans each step alone (no CUDA graphs)")
        starts = [0]
        for n in meta.query_lens_cpu:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        prefill = [i for i, n in enumerate(meta.query_lens_cpu) if n != 1]
        lens = [meta.seq_lens_cpu[i] for i in decode]
        return _Plan(
            work=[starts[i] for i in decode] + decode + lens,
            starts=starts,
            prefill_seqs=prefill,
            decode_seqs=decode,
            decode_max_len=max(lens, default=0),
            decode_min_len=min(lens, default=0),
        )

    def work_size(self, bounds: PlanBounds) -> int:
        return 3 * min(bounds.max_tokens, bounds.max_seqs)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(meta.plan, _Plan):
            self.plan_and_upload(meta)
        plan = meta.plan
        assert isinstance(plan, _Plan)
        if plan.decode_seqs and not plan.prefill_seqs:  # every query row decodes, in order: no scatter
            return self._decode(q, (k_cache, v_cache, k_scale, v_scale), meta, plan, scale, window)
        out = torch.empty_like(q)
        starts = plan.starts
        for i in plan.prefill_seqs:
            qlen, slen = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            # The first query's window starts here; keys before it are read by no query of this step.
            lo = 0 if window is None else max(0, slen - qlen - window + 1)
            kk = read_kv(gather_kv(k_cache, meta.block_tables[i], slen, lo), k_scale)  # float32
            vv = read_kv(gather_kv(v_cache, meta.block_tables[i], slen, lo), v_scale)
            rows = q[starts[i] : starts[i + 1]]
            out[starts[i] : starts[i + 1]] = attend(rows, kk, vv, scale, slen - qlen, window, lo)
        if plan.decode_seqs:
            kv = (k_cache, v_cache, k_scale, v_scale)
            out[plan.decode_rows] = self._decode(q, kv, meta, plan, scale, window)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],  # caches, their scales
        meta: AttentionMetadata,
        plan: _Plan,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Single-token queries, batched: pad every sequence's keys to the longest and mask the rest (and,
        with a window, the keys before it: their blocks may hold another sequence's rows by now)."""
        assert plan.decode_rows is not None and plan.decode_seq_idx is not None and plan.decode_lens is not None
        k_cache, v_cache, k_scale, v_scale = kv
        block_size = k_cache.shape[1]
        max_len = plan.decode_max_len
        if plan.decode_tables is None:
            nb = -(-max_len // block_size)
            plan.decode_tables = meta.block_tables[plan.decode_seq_idx, :nb].long()  # [B, nb]
        tables = plan.decode_tables
        kk = read_kv(gather(k_cache, tables).flatten(1, 2)[:, :max_len], k_scale)  # [B, L, Hkv, D] float32
        vv = read_kv(gather(v_cache, tables).flatten(1, 2)[:, :max_len], v_scale)
        qq = (q if not plan.prefill_seqs else q[plan.decode_rows]).float()  # [B, H, D]
        group = qq.shape[1] // kk.shape[2]
        qg = qq.view(qq.shape[0], kk.shape[2], group, qq.shape[2])  # [B, Hkv, G, D]
        scores = torch.einsum("bkgd,blkd->bkgl", qg, kk) * scale  # [B, Hkv, G, L]
        hidden = plan.hidden(window)  # [B, L]
        if hidden is not None:
            scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
            # Padded rows may hold garbage (even NaN in never-written cache memory) and 0 * NaN is NaN.
            vv = vv.masked_fill(hidden[:, :, None, None], 0.0)
        out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), vv)
        return out.reshape(qq.shape).to(q.dtype)
