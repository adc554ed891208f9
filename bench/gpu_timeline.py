"""A GPU timeline reduced to what a throughput profile needs: busy time as the union of device intervals
(streams may overlap, so not a plain sum), the idle gaps between them, and kernel time by category.
Pure Python over (name, start, end) records, so it is tested on CPU without a profiler; w1_profile.py turns
torch.profiler's device events into them. Knows kernel names, not the engine."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInterval:
    name: str
    start_us: float
    end_us: float


# First match wins (case-insensitive substrings): our Triton kernels first, then the generic families whose
# patterns they could also match. GEMM patterns cover cuBLAS/cuBLASLt kernel families on Hopper (nvjet,
# sm90_xmma_gemm, cutlass, gemv, the split-K reduction).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("memcpy_memset", ("memcpy", "memset")),
    ("qk_norm_rope", ("qk_norm_rope",)),
    ("rms_norm", ("rms_norm",)),
    ("silu_mul", ("silu", "gated_act")),  # the gated MLP activation: SiLU or GELU-tanh times up
    ("decode_attention", ("decode",)),
    ("prefill_attention", ("prefill", "flash", "fmha", "attention")),
    ("sampling", ("gumbel", "argmax")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitkreduce", "cublas")),
)
OTHER = "other"
# Gap thresholds in us; each bucket counts every gap above its threshold (so the buckets nest).
GAP_THRESHOLDS_US: tuple[tuple[str, float], ...] = (("gt_20us", 20.0), ("gt_100us", 100.0), ("gt_1ms", 1000.0))


def categorize(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return OTHER


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals (touching ones joined)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def gaps_between(merged: Sequence[tuple[float, float]]) -> list[float]:
    """Idle time between consecutive busy intervals (not before the first or after the last)."""
    return [b[0] - a[1] for a, b in itertools.pairwise(merged)]


def gap_histogram(gaps_us: Sequence[float]) -> dict[str, dict[str, float]]:
    hist = {"all": {"count": len(gaps_us), "total_ms": round(sum(gaps_us) / 1e3, 3)}}
    for label, threshold in GAP_THRESHOLDS_US:
        above = [g for g in gaps_us if g > threshold]
        hist[label] = {"count": len(above), "total_ms": round(sum(above) / 1e3, 3)}
    return hist


@dataclass(frozen=True)
class TimelineSummary:
    num_events: int
    kernel_sum_us: float  # plain sum of every interval's duration
    busy_us: float  # the union: time at least one interval ran
    span_us: float  # first start to last end
    last_end_us: float  # on the intervals' own clock (torch.profiler: from the trace's start)
    gaps_us: list[float]
    categories: dict[str, tuple[float, int]]  # category -> (us, count)
    by_name: dict[str, tuple[float, int]]  # kernel name -> (us, count)


def summarize(events: Sequence[DeviceInterval]) -> TimelineSummary:
    merged = merge((e.start_us, e.end_us) for e in events)
    categories: dict[str, tuple[float, int]] = {}
    by_name: dict[str, tuple[float, int]] = {}
    for e in events:
        for table, key in ((categories, categorize(e.name)), (by_name, e.name)):
            us, n = table.get(key, (0.0, 0))
            table[key] = (us + e.end_us - e.start_us, n + 1)
    return TimelineSummary(
        num_events=len(events),
        kernel_sum_us=sum(e.end_us - e.start_us for e in events),
        busy_us=sum(end - start for start, end in merged),
        span_us=merged[-1][1] - merged[0][0] if merged else 0.0,
        last_end_us=merged[-1][1] if merged else 0.0,
        gaps_us=gaps_between(merged),
        categories=categories,
        by_name=by_name,
    )


def split_off(
    categories: dict[str, tuple[float, int]], source: str, target: str, us: float, count: int
) -> dict[str, tuple[float, int]]:
    """A copy of `categories` with `us`/`count` moved from `source` to a new `target` (e.g. the LM head's
    GEMMs out of "gemm", identified by the op that launched them rather than by kernel name)."""
    out = dict(categories)
    src_us, src_n = out.get(source, (0.0, 0))
    if us > src_us + 1e-6 or count > src_n:
        raise ValueError(f"cannot move {us:.1f} us / {count} from {source!r} holding {src_us:.1f} us / {src_n}")
    out[source] = (src_us - us, src_n - count)
    out[target] = (us, count)
    return out


STEP_END_MARKER = "argmax_reduce"  # the sampler's last kernel: one per engine step


def step_kinds(events: Sequence[DeviceInterval], end_marker: str = STEP_END_MARKER) -> dict[str, dict[str, float]]:
    """Engine steps cut at the sampler's last kernel, split by kind: "mixed" (a prompt chunk ran prefill
    attention in it) or "decode". Per kind: steps, time from one step's end to the next (the step as the
    GPU saw it, idle included), busy time (union of its intervals), and its top categories. Tells whether
    mixed steps are slow for their work (busy) or for the host (idle)."""
    ordered = sorted(events, key=lambda e: e.start_us)
    out: dict[str, dict[str, float]] = {}
    current: list[DeviceInterval] = []
    previous_end: float | None = None
    for e in ordered:
        current.append(e)
        if end_marker not in e.name.lower():
            continue
        if previous_end is not None:  # the first step has no start boundary: left out
            kind = "mixed" if any(categorize(x.name) == "prefill_attention" for x in current) else "decode"
            row = out.setdefault(kind, {"steps": 0, "span_ms": 0.0, "busy_ms": 0.0})
            row["steps"] += 1
            row["span_ms"] += (e.end_us - previous_end) / 1e3
            merged = merge((max(x.start_us, previous_end), x.end_us) for x in current if x.end_us > previous_end)
            row["busy_ms"] += sum(b - a for a, b in merged) / 1e3
            for x in current:
                key = "cat_" + categorize(x.name) + "_ms"
                row[key] = row.get(key, 0.0) + (x.end_us - x.start_us) / 1e3
        previous_end = e.end_us
        current = []
    for row in out.values():
        n = row["steps"] or 1
        row["mean_span_us"] = 1e3 * row["span_ms"] / n
        row["mean_busy_us"] = 1e3 * row["busy_ms"] / n
        for key in list(row):
            row[key] = round(row[key], 2)
    return out
