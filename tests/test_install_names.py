"""No doc, hint or example tells users to install the distribution named `asyncllm`: on the package index
that name belongs to an unrelated project (regression: `pip install 'asyncllm[server]'` in docs/server.md,
the serve error hint and the examples installed it). Ours is `asyncllm-engine`; the import name is asyncllm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncllm.install import DISTRIBUTION, extra_install_hint

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("README.md", "docs", "examples", "src", "scripts", "bench", "kernels")
SUFFIXES = {".md", ".py", ".sh", ".toml", ".txt", ".rst"}
# `pip install [flags] asyncllm` or `... 'asyncllm[extra]'` (its arguments: up to a comment or a closing
# backtick), and the extra syntax on the taken name anywhere.
TAKEN = re.compile(
    r"pip3?\s+install\b[^\n#`]*?(?<![\w.-])['\"]?asyncllm(?![\w-])|(?<![\w./-])asyncllm\[\w+\]",
)


def _files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    return files


@pytest.mark.parametrize(
    "text",
    [
        "pip install 'asyncllm[server]'",
        "pip install asyncllm",
        'pip install -U "asyncllm[triton]"',
        "needs asyncllm[dev]",
    ],
)
def test_the_scan_catches_the_taken_name(text: str) -> None:
    assert TAKEN.search(text)


@pytest.mark.parametrize(
    "text",
    [
        'pip install "asyncllm-engine[server]"',
        'pip install -e ".[server]"',
        "asyncllm serve",
        "import asyncllm",
        "pip install -e .   # the engine: `asyncllm chat`",
    ],
)
def test_the_scan_passes_our_name(text: str) -> None:
    assert not TAKEN.search(text)


def test_no_doc_hint_or_example_installs_the_taken_name() -> None:
    files = _files()
    assert len(files) > 50  # the scan reads the tree, not nothing
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for path in files
        for text in [path.read_text(errors="replace")]
        for m in TAKEN.finditer(text)
    ]
    assert not found, "install instructions naming the unrelated PyPI project `asyncllm`:\n" + "\n".join(found)


def test_the_distribution_name_is_ours() -> None:
    name = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert name is not None and name.group(1) == DISTRIBUTION == "asyncllm-engine"
    assert DISTRIBUTION in extra_install_hint("server") and '".[server]"' in extra_install_hint("server")
