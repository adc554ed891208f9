"""No name we put on `sys.path` shadows a module of the standard library or of an installed distribution.

Regression: the top-level kernels/ folder was a regular package. Wherever the repository root was on
`sys.path` (pytest's rootdir insertion, `python -c` or `python -m` run there, worker processes that inherit
the path), `import kernels` found it instead of Hugging Face's `kernels`, which transformers 5.25 imports,
and the whole suite stopped at collection. The folder is now a namespace portion (no `__init__.py`), which
any installed package of that name outranks.

The folders checked are the root and every folder holding a script run as a file (a `__main__` guard):
Python puts the script's own folder first on `sys.path`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAIN_GUARD = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)


def _is_ours(path: str) -> bool:
    """Whether a module's file lies in this checkout, outside the environment (`.venv` may sit inside it)."""
    resolved = Path(path).resolve()
    return ROOT in resolved.parents and Path(sys.prefix).resolve() not in resolved.parents


@functools.cache
def _tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:  # not a git checkout (an unpacked sdist): every file on disk
        return [p for p in ROOT.rglob(pattern) if ".venv" not in p.parts]
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).exists()]


@functools.cache
def _path_folders() -> list[Path]:
    scripts = {p.parent for p in _tracked("*.py") if MAIN_GUARD.search(p.read_text(encoding="utf-8"))}
    # Modules under src/ are run with `python -m`, which puts the working folder on the path, not theirs.
    return [ROOT, *sorted(f for f in scripts if ROOT / "src" not in f.parents)]


def _names(folder: Path) -> dict[str, bool]:
    """The top-level import names a folder on `sys.path` provides: name -> whether it is a regular module or
    package (which shadows whatever comes later on the path) rather than a namespace portion (which loses)."""
    tracked = {p.relative_to(folder).parts[0] for p in _tracked("*.py") if folder in p.parents}
    names: dict[str, bool] = {}
    for entry in tracked:
        path = folder / entry
        if entry.endswith(".py"):
            names[entry[:-3]] = True
        elif path.is_dir():
            names[entry] = (path / "__init__.py").exists()
    return names


@functools.cache
def _taken() -> frozenset[str]:
    return frozenset(sys.stdlib_module_names) | frozenset(importlib.metadata.packages_distributions())


def _resolve(name: str, cwd: Path) -> list[str]:
    """Where `import name` leads in a fresh interpreter whose `sys.path` starts with `cwd`."""
    code = (
        f"import importlib.util as u; s = u.find_spec({name!r}); "
        "print(*([s.origin] if s.origin not in (None, 'namespace') else s.submodule_search_locations), sep='\\n')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("folder", _path_folders(), ids=lambda f: str(f.relative_to(ROOT)) or ".")
def test_no_module_of_ours_shadows_a_taken_name(folder: Path) -> None:
    clashes = sorted(n for n, regular in _names(folder).items() if regular and n in _taken())
    assert not clashes, f"{folder.relative_to(ROOT)}/ shadows installed or standard modules: {clashes}; rename them"


@pytest.mark.parametrize("folder", _path_folders(), ids=lambda f: str(f.relative_to(ROOT)) or ".")
def test_a_namespace_portion_of_ours_loses_to_the_installed_package(folder: Path) -> None:
    for name in sorted(n for n, regular in _names(folder).items() if not regular and n in _taken()):
        where = _resolve(name, folder)
        assert not any(_is_ours(p) for p in where), f"`import {name}` from {folder} finds ours: {where}"


def test_hugging_face_kernels_is_installed() -> None:
    """The checks below prove something only where the package they protect is present (a dev dependency)."""
    assert "kernels" in importlib.metadata.packages_distributions().get("kernels", [])


def _kernels_origin() -> str:
    import kernels

    return str(kernels.__file__)


def test_kernels_is_hugging_faces_in_pytest_and_in_spawned_workers() -> None:
    assert str(ROOT) in sys.path or "" in sys.path or any(Path(p).resolve() == ROOT for p in sys.path if p)
    assert not _is_ours(_kernels_origin())
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a worker inherits this path, root included
        assert not _is_ours(pool.apply(_kernels_origin))


@pytest.mark.slow
def test_transformers_imports_from_the_repo_root() -> None:
    """The import that failed at collection: transformers' activations import `kernels` when present."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import transformers.activations, kernels; print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not _is_ours(out.stdout.strip())
