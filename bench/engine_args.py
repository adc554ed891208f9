"""`--engine-arg NAME=VALUE` for the benchmarks: engine keyword arguments from the command line, so one
device call can compare variants (VALUE is read as JSON when it parses: 2048, null, true; else a string), and
what several engines built one after another in one process need between them (`free_device_memory`).
A tuning variable's lower-case name (`cuda_graph_max_tokens=0`: asyncllm.envs, docs/tuning.md) sets
ASYNCLLM_CUDA_GRAPH_MAX_TOKENS in this process's environment instead, for the engines it makes next (and the
processes they start); `tuning_env` does the same from a script."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from asyncllm import envs


def add_engine_arg_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an engine keyword argument (repeatable), e.g. max_prefill_tokens_while_decoding=2048; a tuning "
        "variable's lower-case name (cuda_graph_max_tokens=0) sets ASYNCLLM_CUDA_GRAPH_MAX_TOKENS instead",
    )


def tuning_variable(name: str) -> str | None:
    """ASYNCLLM_<NAME> when that is a tuning variable (asyncllm.envs.ALL), else None."""
    variable = "ASYNCLLM_" + name.upper()
    return variable if variable in {var.name for var in envs.ALL} else None


def engine_kwargs(pairs: list[str]) -> dict[str, Any]:
    """The engine keyword arguments of `--engine-arg` pairs; a tuning variable's pair is set in os.environ
    (its VALUE as written: on, 0, true, auto) and left out."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--engine-arg wants NAME=VALUE, got {pair!r}")
        variable = tuning_variable(name)
        if variable is not None:
            os.environ[variable] = text
            continue
        try:
            out[name] = json.loads(text)
        except json.JSONDecodeError:
            out[name] = text
    return out


@contextlib.contextmanager
def tuning_env(**values: object) -> Iterator[None]:
    """Set tuning variables by lower-case name for the engines made inside (`tuning_env(decode_gemv="on")`;
    True/False as 1/0, None leaves the variable unset: its default), restoring the environment after."""
    saved: dict[str, str | None] = {}
    try:
        for name, value in values.items():
            variable = tuning_variable(name)
            if variable is None:
                raise SystemExit(f"{name!r} is no tuning variable (asyncllm.envs.ALL)")
            saved.setdefault(variable, os.environ.get(variable))
            _set(variable, None if value is None else str(int(value)) if isinstance(value, bool) else str(value))
        yield
    finally:
        for variable, before in saved.items():
            _set(variable, before)


def _set(variable: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = value


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
