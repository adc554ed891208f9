"""The built wheel is the distribution `asyncllm-engine` (the name `asyncllm` on PyPI is another project's),
carries every subpackage, top-level kernels/ included as `asyncllm.kernels`, and installs the `asyncllm`
command, whose `--version` finds the distribution by that name."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes or servers: seconds each

ROOT = Path(__file__).resolve().parents[1]


def _source_packages() -> set[str]:
    # Every folder of Python modules; asyncllm.kernels (the link to kernels/) has no __init__.py on purpose.
    src = ROOT / "src"
    return {
        ".".join(Path(folder).relative_to(src).parts)
        for folder, _, files in os.walk(src / "asyncllm", followlinks=True)
        if any(f.endswith(".py") for f in files)
    }


def test_wheel_installs_in_fresh_venv_with_kernels(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("asyncllm_engine-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith(".py")}
    assert _source_packages() <= shipped, f"missing from the wheel: {_source_packages() - shipped}"
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # this pip installs into it (`--python`): no seconds of ensurepip
    py = env_dir / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True)
    out = subprocess.run(
        [
            str(py),
            "-c",
            "import asyncllm, importlib.util as u, sys; "
            "print(u.find_spec('asyncllm.kernels.rms_norm').origin, 'torch' in sys.modules)",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout.split()
    assert "site-packages/asyncllm/kernels/rms_norm.py" in out[0]
    assert out[1] == "False", "importing asyncllm must not import torch"
    check = "import asyncllm, importlib.metadata as m; print(m.version('asyncllm-engine') == asyncllm.__version__)"
    same = subprocess.run([str(py), "-c", check], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert same.strip() == "True", "the distribution's version is asyncllm.__version__"
    version = subprocess.run(
        [str(env_dir / "bin" / "asyncllm"), "--version"], check=True, capture_output=True, text=True, cwd=tmp_path
    ).stdout
    assert version.startswith("asyncllm 0.1.0 (asyncllm-engine 0.1.0;"), version
