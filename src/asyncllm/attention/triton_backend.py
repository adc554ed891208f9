"""The Triton attention backend: stores k/v with torch, then runs the paged Triton kernels of
asyncllm.kernels.paged_attention (split-KV decode for single-token sequences, a varlen causal prefill for
the rest). `plan` turns the step's host-side lengths into the kernels' launch plans once per step; with
cascade decode on (`cascade`), a decode step whose sequences share prefix blocks gets the cascade plan
(attention/cascade.py), a graph variant of its own. An FP8 cache is read by the same kernels (its scales
handed through). With `fold_reduce` (a plan field, so a benchmark can flip it), a multi-split decode is one
launch: the split kernel merges its own splits through a ticket counter per (decode entry, KV head), kept
zeroed here between launches; off (and for cascade's merge), the separate reduce kernel.

Knows the kernels' launch contracts, not their insides; the torch backend stays the reference it is tested against.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata, AttentionPlan, PlanBounds
from asyncllm.attention.cascade import CascadeDecode, CascadeLayout, cascade_layout, plan_cascade
from asyncllm.errors import InvalidConfigError
from asyncllm.install import extra_install_hint
from asyncllm.kernels.kv_cache_fp8_ref import KV_FP8_DTYPE
from asyncllm.kernels.paged_attention_plan import TILES_HEADER as _TILES_HEADER

TILES_HEADER: int = _TILES_HEADER  # typed here: mypy does not see the kernels/ folder as asyncllm.kernels

_FIX = "use attention_backend='torch' (or 'auto')"
_FEW_DECODES = 8  # the decode count a graphed mixed step's split count is planned for


def load_paged_attention() -> ModuleType:
    """The kernel module (imports triton). Raises InvalidConfigError naming the fix when triton is missing."""
    try:
        return importlib.import_module("asyncllm.kernels.paged_attention")
    except ModuleNotFoundError as err:
        if err.name == "triton":
            raise InvalidConfigError(
                f"attention_backend='triton' needs triton ({extra_install_hint('triton')}), or {_FIX}"
            ) from err
        raise


@dataclass
class TritonPlan(AttentionPlan):
    """The kernels' launch plan. `work` (int32): the decode sequences' order (padded to a multiple of four
    entries, so the tile buffer that follows starts 16-byte aligned), then the prefill tile buffer."""

    work: list[int] | np.ndarray  # a cascade plan's is made in numpy: staged without a list's conversions
    num_decode: int  # decode programs: the first entries of `work`, each a batch index; -1: padding
    tiles_offset: int | None  # where the tile buffer starts in `work`; None: no prefill tiles
    decode_max_len: int  # bound on the decode sequences' lengths (keys), host side: sets the split count
    num_splits: int  # KV splits per decode sequence and KV head
    split_seqs: int  # the decode count the split count was chosen for (a window's split count uses it too)
    prefill_programs: int = 0  # prefill programs per head: one per tile eagerly, fixed in a graph
    padded: bool = False  # rows of no sequence follow the step's: their output is zeroed, never garbage
    decode_seqs: torch.Tensor | None = None  # [num_decode] int32 on the device (`bind`)
    prefill_tiles: torch.Tensor | None = None  # int32 tile buffer (kernels.tile_buffer): live count, then tiles
    window_splits: dict[int, int] = field(default_factory=dict)  # sliding window -> its decode split count
    cascade: CascadeLayout | None = None  # a cascade decode plan's lists, after the decode order in `work`
    cascade_args: object | None = None  # their launch argument (kernels' `Cascade`), on the device (`bind`)
    fold_reduce: bool = True  # the split kernel merges its splits (one launch); False: the reduce kernel's launch

    @property
    def graph_variant(self) -> int:
        return 0 if self.cascade is None else 1

    def bind(self, work: torch.Tensor) -> None:
        n = self.num_decode
        # A decode graph's work is its order alone: the tensor itself (the same object every step), no view.
        self.decode_seqs = None if n == 0 else work if n == len(self.work) else work[:n]
        self.prefill_tiles = None if self.tiles_offset is None else work[self.tiles_offset :]
        if self.cascade is not None:
            self.cascade_args = self.cascade.bind(work)


@dataclass(frozen=True)
class _MixedLayout:
    """Where a static mixed plan's work list puts things, for one pair of bounds."""

    decode_capacity: int  # decode programs: every sequence could be a decode
    tiles_offset: int  # 16-byte aligned
    tile_capacity: int

    @property
    def size(self) -> int:
        return self.tiles_offset + TILES_HEADER + 2 * self.tile_capacity


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton on CUDA. On CPU it runs only in Triton's interpreter, i.e. when
    TRITON_INTERPRET=1 was set before triton was imported (slow: for tests); otherwise construction raises."""

    name = "triton"
    supports_cuda_graphs = True
    work_dtype = torch.int32

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        num_kv_heads: int,
        kv_cache_dtype: torch.dtype | None = None,
        cascade: CascadeDecode | None = None,  # cascade decode attention's settings; None: off
        fold_reduce: bool = True,  # plans fold the decode reduce into the split kernel (`TritonPlan.fold_reduce`)
        pdl: bool = False,  # the decode split kernel launched as a programmatic dependent (kernels/pdl.py)
    ) -> None:
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
        if kv_cache_dtype == KV_FP8_DTYPE and device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):  # Triton converts e4m3 on Ada and Hopper only
                raise InvalidConfigError(
                    f"kv_cache_dtype='fp8' with attention_backend='triton' needs a GPU of compute capability 8.9 or "
                    f"later; this one is {major}.{minor}: use attention_backend='torch', or kv_cache_dtype='auto'"
                )
        if pdl and device.type != "cuda":
            raise InvalidConfigError(  # worker/device.py's check_pdl words, before the weights load
                f"ASYNCLLM_DECODE_PDL=1 launches the Triton backend's kernels on CUDA; this engine runs on {device}: "
                "unset ASYNCLLM_DECODE_PDL"
            )
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.pdl = pdl
        self.block_m = self._kernels.prefill_block_m(dtype, device)
        props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
        self.num_sms = props.multi_processor_count if props is not None else 1
        self._layouts: dict[tuple[int, int], _MixedLayout] = {}  # (max_tokens, max_seqs) -> static layout
        self.cascade = cascade
        self._cascade_layouts: dict[tuple[int, int], CascadeLayout] = {}  # (max_seqs, max_seq_len) -> layout
        self.fold_reduce = fold_reduce
        # The folded reduce's tickets, [decode entries x KV heads] int32, zero between launches (each launch
        # leaves them so; the layers run one after another on one stream). Grown on the host in `plan`, never
        # during a capture; earlier ones are kept, as captured graphs hold their addresses.
        self._counters: list[torch.Tensor] = []

    def _work(self, meta: AttentionMetadata) -> tuple[list[int], list[tuple[int, int]]]:
        """The step's work lists: the single-query sequences (the decode kernel's), and the prefill tiles."""
        qlens = meta.query_lens_cpu
        decode = _longest_first([i for i, n in enumerate(qlens) if n == 1], meta.seq_lens_cpu)
        return decode, self._kernels.plan_prefill_tiles(qlens, meta.seq_lens_cpu, self.block_m)

    def work_size(self, bounds: PlanBounds) -> int:
        if bounds.decode_only:
            return self._cascade_layout(bounds).size if 1 in self.graph_variants(bounds) else bounds.max_seqs
        return self._layout(bounds).size

    def graph_variants(self, bounds: PlanBounds) -> tuple[int, ...]:
        """Plain, and with cascade decode on, cascade (1) for decode buckets of two sequences or more."""
        return (0, 1) if self.cascade is not None and bounds.decode_only and bounds.max_seqs >= 2 else (0,)

    def plan(self, meta: AttentionMetadata, bounds: PlanBounds | None = None, variant: int | None = None) -> TritonPlan:
        plan = self._plan(meta, bounds, variant)
        plan.fold_reduce = self.fold_reduce
        if plan.num_decode:  # reserved either way (a few KB): a benchmark may turn a plan's fold on
            self._reserve_counters(plan.num_decode)
        return plan

    def _plan(self, meta: AttentionMetadata, bounds: PlanBounds | None, variant: int | None) -> TritonPlan:
        if bounds is None:
            return self._plan_step(meta)
        if bounds.decode_only:
            if variant != 0 and 1 in self.graph_variants(bounds):
                plan = self._plan_cascade(meta, bounds, forced=variant == 1)
                if plan is not None:
                    return plan
            return self._plan_decode(meta, bounds)
        return self._plan_mixed(meta, bounds)

    def _reserve_counters(self, num_decode: int) -> None:
        need = num_decode * self.num_kv_heads
        if not self._counters or self._counters[-1].shape[0] < need:
            self._counters.append(torch.zeros(need, dtype=torch.int32, device=self.device))

    def _fold_counters(self, plan: TritonPlan) -> torch.Tensor | None:
        """The tickets a decode launch of `plan` folds its reduce with; None: the reduce kernel's launch."""
        if not plan.fold_reduce:
            return None
        counters = self._counters[-1]
        assert counters.shape[0] >= plan.num_decode * self.num_kv_heads, "plan() reserves them"
        return counters

    def _plan_step(self, meta: AttentionMetadata) -> TritonPlan:
        """This step's own plan: one program per decode sequence and per prefill tile."""
        decode, tiles = self._work(meta)
        slens = meta.seq_lens_cpu
        max_len = max((slens[i] for i in decode), default=0)
        offset = _aligned4(len(decode))
        work = decode + [0] * (offset - len(decode)) + (self._kernels.tile_buffer(tiles) if tiles else [])
        return TritonPlan(
            work=work,
            num_decode=len(decode),
            tiles_offset=offset if tiles else None,
            decode_max_len=max_len,
            num_splits=self._kernels.choose_num_splits(max_len, len(decode), self.num_kv_heads, self.num_sms),
            split_seqs=len(decode),
            prefill_programs=len(tiles),
        )

    def _plan_mixed(self, meta: AttentionMetadata, bounds: PlanBounds) -> TritonPlan:
        kernels = self._kernels
        layout = self._layout(bounds)
        qlens = meta.query_lens_cpu
        if len(qlens) > bounds.max_seqs or sum(qlens) > bounds.max_tokens:
            raise ValueError(f"a step of {sum(qlens)} tokens in {len(qlens)} sequences exceeds the plan for {bounds}")
        decode, tiles = self._work(meta)
        pad = layout.tiles_offset - len(decode)  # -1: no sequence, for the decode programs past the real ones
        # Launch shapes depend on the bounds alone. Decode splits are sized for a handful of decodes: a few
        # long sequences beside a prompt must not walk their keys in one program each (a full decode batch
        # fills the GPU anyway; splits past a sequence's end are empty). Prefill programs: enough for a step
        # of one long chunk and to fill the GPU, striding over the tiles when there are more.
        fill = -(-2 * self.num_sms // self.num_kv_heads)  # per query head, counting KV heads (fewer) for it
        max_seq_len = bounds.max_seq_len
        split_seqs = min(layout.decode_capacity, _FEW_DECODES)
        return TritonPlan(
            work=decode + [-1] * pad + kernels.tile_buffer(tiles, layout.tile_capacity),
            num_decode=layout.decode_capacity,
            tiles_offset=layout.tiles_offset,
            decode_max_len=max_seq_len,
            num_splits=kernels.choose_num_splits(max_seq_len, split_seqs, self.num_kv_heads, self.num_sms),
            split_seqs=split_seqs,
            prefill_programs=min(layout.tile_capacity, max(-(-bounds.max_tokens // self.block_m), fill)),
            padded=True,
        )

    def _layout(self, bounds: PlanBounds) -> _MixedLayout:
        key = (bounds.max_tokens, bounds.max_seqs)
        layout = self._layouts.get(key)
        if layout is None:
            decode_capacity = min(bounds.max_tokens, bounds.max_seqs)
            tile_capacity = self._kernels.max_prefill_tiles(bounds.max_tokens, bounds.max_seqs, self.block_m)
            layout = self._layouts[key] = _MixedLayout(decode_capacity, _aligned4(decode_capacity), tile_capacity)
        return layout

    def _plan_decode(self, meta: AttentionMetadata, bounds: PlanBounds) -> TritonPlan:
        # Every step's order, longest first: with lengths spread from hundreds to thousands of keys, the
        # longest programs starting last would leave the GPU idle behind them.
        num_seqs = bounds.max_seqs
        # The split count is fixed per captured size (from the static bound); each sequence then divides its
        # own length, read on the device, so one graph serves every length up to the bound.
        return TritonPlan(
            work=_longest_first(range(num_seqs), meta.seq_lens_cpu),
            num_decode=num_seqs,
            tiles_offset=None,
            decode_max_len=bounds.max_seq_len,
            num_splits=self._kernels.choose_num_splits(bounds.max_seq_len, num_seqs, self.num_kv_heads, self.num_sms),
            split_seqs=num_seqs,
        )

    def _cascade_layout(self, bounds: PlanBounds) -> CascadeLayout:
        assert self.cascade is not None
        key = (bounds.max_seqs, bounds.max_seq_len)
        layout = self._cascade_layouts.get(key)
        if layout is None:
            layout = cascade_layout(self.cascade, *key, self.num_kv_heads, self.num_sms)
            self._cascade_layouts[key] = layout
        return layout

    def _plan_cascade(self, meta: AttentionMetadata, bounds: PlanBounds, forced: bool) -> TritonPlan | None:
        """A decode step whose sequences share prefixes: the cascade plan (`attention/cascade.py`); None when
        none share one (unless `forced`: a graph's capture plans the cascade variant for whatever it holds)."""
        assert self.cascade is not None
        layout = self._cascade_layout(bounds)
        work = plan_cascade(self.cascade, layout, meta, forced)
        if work is None:
            return None
        num_seqs = bounds.max_seqs
        return TritonPlan(
            work=work,
            num_decode=num_seqs,
            tiles_offset=None,
            decode_max_len=bounds.max_seq_len,
            num_splits=layout.num_splits,
            split_seqs=num_seqs,
            cascade=layout,
        )

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
        if not isinstance(meta.plan, TritonPlan):
            self.plan_and_upload(meta)
        plan = meta.plan
        assert isinstance(plan, TritonPlan)
        # Padding rows are attended by no kernel: zeros keep them finite through the layers that follow.
        out = torch.zeros_like(q) if plan.padded else torch.empty_like(q)
        args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        if plan.decode_seqs is not None:
            splits = plan.num_splits if window is None else self._window_splits(plan, window)
            # A sliding layer reads its window as always: the cascade's order is a valid plain work list.
            cascade = plan.cascade_args if window is None else None
            counters = None if cascade is not None else self._fold_counters(plan)  # cascade merges in the reduce
            self._kernels.paged_decode_attention(
                *args, plan.decode_seqs, out, scale, num_splits=splits, window=window, cascade=cascade,
                counters=counters, pdl=self.pdl, **scales,
            )  # fmt: skip
        if plan.prefill_tiles is not None:
            self._kernels.paged_prefill_attention(
                *args,
                plan.prefill_tiles,
                out,
                scale,
                block_m=self.block_m,
                num_programs=plan.prefill_programs,
                window=window,
                **scales,
            )
        return out

    def _window_splits(self, plan: TritonPlan, window: int) -> int:
        """A sliding layer's decode splits: chosen as the plan's, for the keys its window leaves (a function of
        the plan's bounds alone, so a captured graph keeps it)."""
        splits = plan.window_splits.get(window)
        if splits is None:
            keys = min(plan.decode_max_len, window)
            splits = self._kernels.choose_num_splits(keys, plan.split_seqs, self.num_kv_heads, self.num_sms)
            plan.window_splits[window] = splits
        return splits


def _aligned4(n: int) -> int:
    return -(-n // 4) * 4


def _longest_first(seqs: Iterable[int], seq_lens: Sequence[int]) -> list[int]:
    """Decode sequences in the order their programs should start: most keys first."""
    return sorted(seqs, key=seq_lens.__getitem__, reverse=True)  # stable: ties keep batch order
