"""Pure-PyTorch paged attention: the specification every faster backend is tested against.

Written for clarity over speed: gather each sequence's keys from its blocks, attend in float32, causal
within the sequence (query row j of a sequence of length L sits at position L - query_len + j).
Decode-only sequences are batched with padding so the reference stays usable as a GPU baseline.
"""

from __future__ import annotations

import torch

from asyncllm.runner.attention.backend import AttentionBackend, AttentionMetadata


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's key/value into its cache slot."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(
        0, slot_mapping, k.to(k_cache.dtype)
    )
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(
        0, slot_mapping, v.to(v_cache.dtype)
    )


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim]: one sequence's cached rows in token order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int
) -> torch.Tensor:
    """q [Q, H, D], k/v [K, Hkv, D] -> [Q, H, D]; query j may see keys 0..causal_offset + j. float32 maths."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, Q, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, K, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, Q, K]
    qpos = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
    kpos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [H, Q, D]
    return out.transpose(0, 1).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = [0]  # host-side offsets: no device sync
        for n in meta.query_lens_cpu:
            starts.append(starts[-1] + n)
        decode_rows: list[int] = []
        decode_seqs: list[int] = []
        for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if qlen == 1:
                decode_rows.append(starts[i])
                decode_seqs.append(i)
                continue
            kk = gather_kv(k_cache, meta.block_tables[i], slen)
            vv = gather_kv(v_cache, meta.block_tables[i], slen)
            out[starts[i] : starts[i + 1]] = attend(q[starts[i] : starts[i + 1]], kk, vv, scale, slen - qlen)
        if decode_seqs:
            rows = torch.tensor(decode_rows, device=q.device)
            out[rows] = self._decode(q, k_cache, v_cache, meta, decode_rows, decode_seqs, scale)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, rows: list[int], seqs: list[int], scale: float) -> torch.Tensor:
        """Single-token queries, batched: pad every sequence's keys to the longest and mask the rest."""
        device = q.device
        block_size = k_cache.shape[1]
        lens = [meta.seq_lens_cpu[i] for i in seqs]
        max_len = max(lens)
        nb = -(-max_len // block_size)
        idx = torch.tensor(seqs, device=device)
        tables = meta.block_tables[idx, :nb].long()  # [B, nb]
        kk = k_cache[tables].flatten(1, 2)[:, :max_len].float()  # [B, L, Hkv, D]
        vv = v_cache[tables].flatten(1, 2)[:, :max_len].float()
        qq = q[torch.tensor(rows, device=device)].float()  # [B, H, D]
        group = qq.shape[1] // kk.shape[2]
        qg = qq.view(qq.shape[0], kk.shape[2], group, qq.shape[2])  # [B, Hkv, G, D]
        scores = torch.einsum("bkgd,blkd->bkgl", qg, kk) * scale  # [B, Hkv, G, L]
        valid = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        # Padded rows may hold garbage (even NaN in never-written cache memory) and 0 * NaN is NaN.
        vv = vv.masked_fill(~valid[:, :, None, None], 0.0)
        out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), vv)
        return out.reshape(qq.shape).to(q.dtype)
