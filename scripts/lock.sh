#!/usr/bin/env bash
# Refreshes the lock (constraints.txt): resolves the newest versions pyproject.toml allows into .venv-latest,
# runs the whole suite there (scripts/test.sh --latest), and only if it passes writes what is installed as
# the new lock. Review the diff and commit it. docs/install.md says why the lock is a pip constraints file.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/test.sh --latest "$@"
{
  echo "# The lock: exact versions the CPU suite last passed with (scripts/lock.sh wrote it; docs/install.md)."
  echo "# scripts/setup.sh installs from it; torch is pinned there (2.13.0, the CPU build), never here."
  .venv-latest/bin/python -m pip --disable-pip-version-check freeze --exclude-editable |
    grep -v -i -E '^(torch|pip|setuptools|wheel)==' | LC_ALL=C sort -f
} >constraints.txt
echo "lock: constraints.txt written from .venv-latest; review with git diff constraints.txt" >&2
