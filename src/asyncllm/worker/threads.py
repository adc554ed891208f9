"""How many CPU threads torch runs the model's ops with, and applying it in the thread that runs steps.

torch's intra-op pool (OpenMP) keeps its size per thread once that thread has run an op, so the worker sets it
in the thread that builds and then steps the model (the engine's step thread, `LLM`'s caller, a TP worker
process). Its default spins on every core torch finds; when another busy process shares them, each op waits
for a descheduled peer and a CPU decode step slows several times over (bench/RESULTS.md, cpu_first_hour).
Knows nothing of the model or of requests.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch


def available_cores() -> int:
    """Physical cores this process may run on: its CPU affinity, counted once per core (hyperthreads share
    one), capped by a cgroup v2 CPU quota (containers)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:  # no sysfs (not Linux, or hidden): count every CPU
            cores.add(("cpu", str(cpu)))
            continue
        cores.add((package, core))
    return max(1, min(len(cores), _cgroup_quota_cpus() or len(cores)))


def _cgroup_quota_cpus() -> int | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))


def default_num_threads(device: torch.device, world_size: int = 1) -> int | None:
    """The engine's default per rank: on CPU, the available cores less one (left to the engine's own threads:
    the event loop, streaming, tokenizing, and to whatever else runs on the machine), shared among the ranks,
    at least one; on CUDA None (torch's own default: the host's part of a step is small there)."""
    if device.type != "cpu":
        return None
    return max(1, (available_cores() - 1) // world_size)


def resolve_num_threads(chosen: int | None, device: torch.device, world_size: int = 1) -> int | None:
    """The `num_threads` engine argument, else the default (None: leave torch's)."""
    return chosen if chosen is not None else default_num_threads(device, world_size)


def apply_num_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads for the calling thread (and threads that have run no op yet); None keeps
    torch's. Returns the count in effect."""
    if num_threads is not None and torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()
