"""`ChoiceCache`: the start-up GEMM timings' choices (`gemm_layout.py`) kept on disk, so that a later start on
the same card skips the timing (0.3-1 s of every start) and makes the same choices.

One JSON file per identity: the card (name, compute capability, memory), the driver and CUDA runtime, torch's
and Triton's versions, and the source of the code whose speed was timed (the GEMV kernels, the linear layers,
the folded ops, the choosing itself), under $XDG_CACHE_HOME/asyncllm/tuning (else ~/.cache/asyncllm/tuning).
Within a file, an entry per weight shape, what was timed for it and over how many layers (a shallow model's fit
in L2). Anything else (another card, a driver update, an edited kernel) names another file, so a stale choice is
never read. A file that does not parse, or an entry that is not a choice, is ignored and timed again. A file is
replaced atomically (a temporary file of a unique name, then a rename), merged with what it holds then: engines
starting together at worst time the same shapes twice. `ASYNCLLM_TUNING_CACHE=0` times every start and writes
nothing; so do the tests, but for the cache's own.

A choice only picks among paths that compute the same numbers per layer (a weight layout, cuBLAS or the GEMV),
so a cached one can be slower than a fresh timing would pick, never wrong.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from asyncllm import envs

logger = logging.getLogger(__name__)

_VERSION = 1
_FIELDS = ("transposed", "gemv", "prologue")  # `gemm_layout.GemmChoice`'s
# The code whose speed the timings measure: a change to any of it is a new identity (paths from the package root).
_TIMED_SOURCES = (
    "worker/gemm_layout.py",
    "layers/linear.py",
    "layers/prologue.py",
    "layers/norm.py",  # a folded op's own launch is timed too (`gemm_layout.prologue_saving_us`)
    "layers/activation.py",
    "kernels/quant_matmul_gemv.py",
    "kernels/gemv_plan.py",
    "kernels/gemv_prologue.py",
    "kernels/rms_norm.py",
    "kernels/silu_mul.py",
)


class ChoiceCache:
    """Choices by entry name (`entry`), read from `path` (None: nothing kept) and written back by `save`."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._choices: dict[str, dict[str, bool]] = {}
        self._changed = False
        if path is not None:
            self._choices = _read(path)

    @classmethod
    def for_device(cls, device: torch.device) -> ChoiceCache:
        """The cache for this card and software (one kept nowhere where ASYNCLLM_TUNING_CACHE=0)."""
        if not envs.TUNING_CACHE.get() or device.type != "cuda":
            return cls(None)
        try:
            path = cache_root() / f"gemm-{identity(device_facts(device))}.json"
        except Exception as exc:  # a cache never stops an engine from starting (no home, the card's facts)
            logger.warning("the GEMM choices are not kept: %s", exc)
            return cls(None)
        return cls(path)

    def get(self, entry: str) -> dict[str, bool] | None:
        return self._choices.get(entry)

    def put(self, entry: str, choice: dict[str, bool]) -> None:
        self._choices[entry] = dict(choice)
        self._changed = True

    def save(self) -> None:
        """Write the choices back if any was added, over what the file holds now (another engine, or another
        tensor-parallel rank, may have added its own meanwhile; ours win). A full disk or a read-only home: kept
        in memory only."""
        if self.path is None or not self._changed:
            return
        temp: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            choices = _read(self.path) | self._choices
            fd, temp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:  # a name no other writer (another container's same pid) uses
                json.dump({"version": _VERSION, "choices": choices}, f, indent=1, sort_keys=True)
            os.replace(temp, self.path)
            temp, self._changed = None, False
        except Exception as exc:  # a full disk or a read-only home: kept in memory only
            logger.debug("the GEMM choices were not kept in %s: %s", self.path, exc)
        finally:
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)


def cache_root() -> Path:
    return envs.cache_home() / "tuning"


def device_facts(device: torch.device) -> dict[str, object]:
    """What the timings depend on besides the weight shape: the card, its driver, the libraries."""
    props = torch.cuda.get_device_properties(device)
    driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # CUDA builds only
    return {
        "card": props.name,
        "capability": [props.major, props.minor],
        "memory": props.total_memory,
        "driver": driver() if callable(driver) else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
    }


def identity(facts: dict[str, object]) -> str:
    """A short digest of `facts` and of the timed code's source."""
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode())
    root = Path(__file__).resolve().parents[1]
    for name in _TIMED_SOURCES:
        with contextlib.suppress(OSError):
            digest.update(name.encode() + (root / name).read_bytes())
    return digest.hexdigest()[:20]


def _read(path: Path) -> dict[str, dict[str, bool]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}  # the first start on this card and software
    except Exception as exc:  # unreadable, not JSON, nested past the parser's depth
        logger.warning("ignoring the GEMM choices in %s (%s): timing again", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION or not isinstance(data.get("choices"), dict):
        logger.warning("ignoring the GEMM choices in %s (another format): timing again", path)
        return {}
    return {
        entry: {f: choice[f] for f in _FIELDS}
        for entry, choice in data["choices"].items()
        if isinstance(choice, dict) and all(isinstance(choice.get(f), bool) for f in _FIELDS)
    }


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except Exception:  # not installed, or broken: the identity just says so
        return None
