"""Where a disk-tier restore's time goes (issue 44), for bench/kv_tiers.py's `--trace`: wraps the worker's KV tier
methods in this process (the engine's step thread runs here) and records, on one clock, each step's tier work,
each disk read as it arrives, each restore's copies on the device and each forward pass. A profiling aid that
reaches into the worker's classes on purpose: it is not an interface, and tests do not use it.

`install()` once before the engine starts; `timeline(t0)` after the request: the events since `t0` (seconds, from
`time.perf_counter`) as compact rows; `uninstall()` puts the worker's methods back and forgets the events.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

_events: list[tuple[float, str, str]] = []  # (time, what, detail)
_pending_gpu: list[tuple[Any, Any, str]] = []  # (base event, end event, label): resolved in timeline()
_lock = threading.Lock()
_base: list[Any] = []  # [cuda event, perf_counter at it]
_originals: list[tuple[Any, str, Any]] = []  # (class, method name, the method before install)


def _note(what: str, detail: str = "", at: float | None = None) -> None:
    with _lock:
        _events.append((time.perf_counter() if at is None else at, what, detail))


def install() -> None:
    import torch

    from asyncllm.worker import kv_disk, kv_host, kv_tiers, model_runner

    for cls, name in (
        (kv_tiers.WorkerKVTiers, "before_forward"),
        (kv_disk.DiskKVStore, "_loaded"),
        (kv_host.HostKVPool, "to_device"),
        (model_runner.ModelRunner, "submit"),
    ):
        _originals.append((cls, name, cls.__dict__[name]))

    before = kv_tiers.WorkerKVTiers.before_forward

    @functools.wraps(before)
    def before_forward(self: Any, kv: Any, idle: bool = False) -> Any:
        t = time.perf_counter()
        loaded = before(self, kv, idle)
        n = len(loaded) if loaded else 0
        _note(
            "tiers",
            f"loads={len(kv.loads)} restores={len(kv.restores)} idle={idle} reported={n} "
            f"took={1e3 * (time.perf_counter() - t):.2f}ms",
            t,
        )
        return loaded

    kv_tiers.WorkerKVTiers.before_forward = before_forward  # type: ignore[method-assign]

    loaded = kv_disk.DiskKVStore._loaded

    @functools.wraps(loaded)
    def _loaded(self: Any, block_hash: int, path: Any, problem: Any) -> bool:
        ok = loaded(self, block_hash, path, problem)  # a read's verdict, as it reaches the engine (either reader)
        _note("read", f"ok={ok}")
        return ok

    kv_disk.DiskKVStore._loaded = _loaded  # type: ignore[method-assign]

    to_device = kv_host.HostKVPool.to_device

    @functools.wraps(to_device)
    def to_device_traced(self: Any, pairs: Any, after_copies: bool = False) -> None:
        t = time.perf_counter()
        start = None
        if self.restore_stream is not None and pairs:
            if not _base:
                base = torch.cuda.Event(enable_timing=True)
                base.record()
                base.synchronize()
                _base.extend([base, time.perf_counter()])
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.restore_stream)
        to_device(self, pairs, after_copies)
        if not pairs:
            return
        _note("restore", f"{len(pairs)} blocks issued in {1e3 * (time.perf_counter() - t):.2f}ms", t)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.restore_stream)
            with _lock:
                _pending_gpu.append((start, end, f"restore of {len(pairs)} blocks on the device"))

    kv_host.HostKVPool.to_device = to_device_traced  # type: ignore[method-assign]

    submit = model_runner.ModelRunner.submit

    @functools.wraps(submit)
    def submit_traced(self: Any, scheduled: Any) -> Any:
        t = time.perf_counter()
        tokens = sum(len(s.input_token_ids) for s in scheduled.seqs) if scheduled.seqs else 0
        step = submit(self, scheduled)
        _note(
            "forward", f"rows={len(scheduled.seqs)} tokens={tokens} launch={1e3 * (time.perf_counter() - t):.2f}ms", t
        )
        return step

    model_runner.ModelRunner.submit = submit_traced  # type: ignore[method-assign]


def timeline(t0: float) -> list[str]:
    """The events since `t0`, as rows "+ms what detail"; the disk reads' arrivals folded into quartiles."""
    import torch

    rows: list[tuple[float, str]] = []
    with _lock:
        events = [e for e in _events if e[0] >= t0]
        gpu = list(_pending_gpu)
    arrived = sorted(e[0] for e in events if e[1] == "read")
    if arrived:
        rows.append((arrived[0], f"reads: the first of {len(arrived)} in"))
        for q in (0.25, 0.5, 0.75):
            rows.append((arrived[int(q * (len(arrived) - 1))], f"reads: {q:.0%} in"))
        rows.append((arrived[-1], "reads: the last in"))
    rows += [(t, f"{what} {detail}") for t, what, detail in events if what != "read"]
    if gpu and _base:
        torch.cuda.synchronize()
        base, base_t = _base
        for start, end, label in gpu:
            s = base_t + base.elapsed_time(start) / 1e3
            if s >= t0:
                rows.append((s, f"{label}: {start.elapsed_time(end):.2f}ms on the device"))
    return [f"+{1e3 * (t - t0):8.2f}ms  {text}" for t, text in sorted(rows)]


def uninstall() -> None:
    while _originals:
        cls, name, method = _originals.pop()
        setattr(cls, name, method)
    with _lock:
        _events.clear()
        _pending_gpu.clear()
    _base.clear()
