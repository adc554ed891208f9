"""`--engine-arg NAME=VALUE` for the benchmarks: engine keyword arguments from the command line, so one
device call can compare variants (VALUE is read as JSON when it parses: 2048, null, true; else a string), and
what several engines built one after another in one process need between them (`free_device_memory`)."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from typing import Any


def add_engine_arg_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an engine keyword argument (repeatable), e.g. max_prefill_tokens_while_decoding=2048",
    )


def engine_kwargs(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--engine-arg wants NAME=VALUE, got {pair!r}")
        try:
            out[name] = json.loads(text)
        except json.JSONDecodeError:
            out[name] = text
    return out


def run_child(script: str, kind: str) -> dict[str, Any]:
    """Run `script` again with this process's arguments plus `--child kind` (a variant in a fresh process, the
    device's memory whole for it) and return the last JSON line it printed; its stderr's tail if it failed."""
    done = subprocess.run(
        [sys.executable, script, *sys.argv[1:], "--child", kind], capture_output=True, text=True, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {kind} run failed:\n{done.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def free_device_memory() -> None:
    """After an engine's shutdown (and its last reference dropped): collect it and hand the CUDA caching
    allocator's blocks back, so the next engine in this process sizes its KV cache from a free device."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
