"""The Triton attention backend: stores k/v with torch, then runs the paged Triton kernels of
asyncllm.kernels.paged_attention (split-KV decode for single-token sequences, a varlen causal prefill for
the rest). `prepare` turns the step's host-side lengths into the kernels' launch plans once per step.

Knows the kernels' launch contracts, not their insides; the torch backend stays the reference it is tested against.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata, AttentionPlan
from asyncllm.errors import InvalidConfigError
from asyncllm.layers.host_copy import copy_into, to_device

_FIX = "use attention_backend='torch' (or 'auto')"
_FEW_DECODES = 8  # the decode count a graphed mixed step's split count is planned for


def load_paged_attention() -> ModuleType:
    """The kernel module (imports triton). Raises InvalidConfigError naming the fix when triton is missing."""
    try:
        return importlib.import_module("asyncllm.kernels.paged_attention")
    except ModuleNotFoundError as err:
        if err.name == "triton":
            raise InvalidConfigError(
                f"attention_backend='triton' needs triton: pip install 'asyncllm[triton]', or {_FIX}"
            ) from err
        raise


@dataclass
class TritonPlan(AttentionPlan):
    decode_seqs: torch.Tensor | None  # [Bd] int32: batch index of each single-query sequence; -1: padding
    decode_max_len: int  # bound on the decode sequences' lengths (keys), host side: sets the split count
    num_splits: int  # KV splits per decode sequence and KV head
    prefill_tiles: torch.Tensor | None  # int32 tile buffer (kernels.tile_buffer): live count, then the tiles
    prefill_programs: int = 0  # prefill programs per head: one per tile eagerly, fixed in a graph
    padded: bool = False  # rows of no sequence follow the step's: their output is zeroed, never garbage


@dataclass
class _MixedBuffers:
    """The device work list one captured mixed-step size reads, rewritten by each step it replays."""

    work: torch.Tensor  # int32: decode_seqs (capacity rounded up to 4), then the tile buffer
    decode_seqs: torch.Tensor  # view of the first decode_capacity entries
    tiles: torch.Tensor  # view from tiles_offset, 16-byte aligned
    decode_capacity: int
    tiles_offset: int
    tile_capacity: int


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton on CUDA. On CPU it runs only in Triton's interpreter, i.e. when
    TRITON_INTERPRET=1 was set before triton was imported (slow: for tests); otherwise construction raises."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, device: torch.device, dtype: torch.dtype, num_kv_heads: int) -> None:
        self._kernels = load_paged_attention()
        if device.type != "cuda" and not self._kernels.runs_in_interpreter():
            hint = "" if os.environ.get("TRITON_INTERPRET") != "1" else " (TRITON_INTERPRET=1 came after the import)"
            raise InvalidConfigError(
                f"attention_backend='triton' needs a CUDA device, got device={device.type!r}{hint}: {_FIX}, or set "
                "TRITON_INTERPRET=1 before starting Python to run the kernels in Triton's CPU interpreter (slow)"
            )
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidConfigError(
                f"attention_backend='triton' supports float32/float16/bfloat16, not dtype={dtype}: {_FIX}"
            )
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.block_m = self._kernels.prefill_block_m(dtype, device)
        props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
        self.num_sms = props.multi_processor_count if props is not None else 1
        self._graph_seqs: dict[int, torch.Tensor] = {}  # num_seqs -> each step's decode order (graphs read it)
        self._mixed: dict[tuple[int, int], _MixedBuffers] = {}  # (max_tokens, max_seqs) -> work list

    def _work(self, meta: AttentionMetadata) -> tuple[list[int], list[tuple[int, int]]]:
        """The step's work lists: the single-query sequences (the decode kernel's), and the prefill tiles."""
        qlens = meta.query_lens_cpu
        decode = _longest_first([i for i, n in enumerate(qlens) if n == 1], meta.seq_lens_cpu)
        return decode, self._kernels.plan_prefill_tiles(qlens, meta.seq_lens_cpu, self.block_m)

    def prepare(self, meta: AttentionMetadata) -> None:
        kernels, slens = self._kernels, meta.seq_lens_cpu
        device = meta.seq_lens.device
        decode, tiles = self._work(meta)
        max_len = max((slens[i] for i in decode), default=0)
        meta.plan = TritonPlan(
            decode_seqs=to_device(decode, torch.int32, device) if decode else None,
            decode_max_len=max_len,
            num_splits=kernels.choose_num_splits(max_len, len(decode), self.num_kv_heads, self.num_sms),
            prefill_tiles=to_device(kernels.tile_buffer(tiles), torch.int32, device) if tiles else None,
            prefill_programs=len(tiles),
        )

    def plan_graph_mixed(self, meta: AttentionMetadata, max_tokens: int, max_seqs: int, max_seq_len: int) -> None:
        kernels = self._kernels
        key = (max_tokens, max_seqs)
        buf = self._mixed.get(key)
        if buf is None:
            buf = self._mixed[key] = self._mixed_buffers(max_tokens, max_seqs)
        qlens = meta.query_lens_cpu
        if len(qlens) > max_seqs or sum(qlens) > max_tokens:
            raise ValueError(f"a step of {sum(qlens)} tokens in {len(qlens)} sequences exceeds the plan for {key}")
        decode, tiles = self._work(meta)
        pad = buf.tiles_offset - len(decode)  # -1: no sequence, for the decode programs past the real ones
        copy_into(buf.work, decode + [-1] * pad + kernels.tile_buffer(tiles, buf.tile_capacity))  # one copy
        # Launch shapes depend on the bounds alone. Decode splits are sized for a handful of decodes: a few
        # long sequences beside a prompt must not walk their keys in one program each (a full decode batch
        # fills the GPU anyway; splits past a sequence's end are empty). Prefill programs: enough for a step
        # of one long chunk and to fill the GPU, striding over the tiles when there are more.
        fill = -(-2 * self.num_sms // self.num_kv_heads)  # per query head, counting KV heads (fewer) for it
        meta.plan = TritonPlan(
            decode_seqs=buf.decode_seqs,
            decode_max_len=max_seq_len,
            num_splits=kernels.choose_num_splits(
                max_seq_len, min(buf.decode_capacity, _FEW_DECODES), self.num_kv_heads, self.num_sms
            ),
            prefill_tiles=buf.tiles,
            prefill_programs=min(buf.tile_capacity, max(-(-max_tokens // self.block_m), fill)),
            padded=True,
        )

    def _mixed_buffers(self, max_tokens: int, max_seqs: int) -> _MixedBuffers:
        decode_capacity = min(max_tokens, max_seqs)
        tile_capacity = self._kernels.max_prefill_tiles(max_tokens, max_seqs, self.block_m)
        offset = -(-decode_capacity // 4) * 4  # the tile buffer starts 16-byte aligned
        size = offset + self._kernels.TILES_HEADER + 2 * tile_capacity
        work = torch.zeros(size, dtype=torch.int32, device=self.device)
        return _MixedBuffers(work, work[:decode_capacity], work[offset:], decode_capacity, offset, tile_capacity)

    def plan_graph_decode(self, meta: AttentionMetadata, num_seqs: int, max_seq_len: int) -> None:
        # Every step's order, longest first, into the buffer the graph reads: with lengths spread from
        # hundreds to thousands of keys, the longest programs starting last would leave the GPU idle behind them.
        order = _longest_first(range(num_seqs), meta.seq_lens_cpu)
        if meta.work is not None and meta.work.numel >= num_seqs:
            meta.work.put(order)  # sent with the step's inputs
            seqs = meta.work.view(num_seqs)
        else:
            seqs = self._graph_seqs.get(num_seqs)
            if seqs is None:
                seqs = self._graph_seqs[num_seqs] = torch.empty(num_seqs, dtype=torch.int32, device=self.device)
            copy_into(seqs, order)
        # The split count is fixed per captured size (from the static bound); each sequence then divides its
        # own length, read on the device, so one graph serves every length up to the bound.
        meta.plan = TritonPlan(
            decode_seqs=seqs,
            decode_max_len=max_seq_len,
            num_splits=self._kernels.choose_num_splits(max_seq_len, num_seqs, self.num_kv_heads, self.num_sms),
            prefill_tiles=None,
        )

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if not isinstance(meta.plan, TritonPlan):
            self.prepare(meta)
        plan = meta.plan
        assert isinstance(plan, TritonPlan)
        # Padding rows are attended by no kernel: zeros keep them finite through the layers that follow.
        out = torch.zeros_like(q) if plan.padded else torch.empty_like(q)
        args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        if plan.decode_seqs is not None:
            self._kernels.paged_decode_attention(*args, plan.decode_seqs, out, scale, num_splits=plan.num_splits)
        if plan.prefill_tiles is not None:
            self._kernels.paged_prefill_attention(
                *args, plan.prefill_tiles, out, scale, block_m=self.block_m, num_programs=plan.prefill_programs
            )
        return out


def _longest_first(seqs: Iterable[int], seq_lens: Sequence[int]) -> list[int]:
    """Decode sequences in the order their programs should start: most keys first."""
    return sorted(seqs, key=seq_lens.__getitem__, reverse=True)  # stable: ties keep batch order
