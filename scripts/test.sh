#!/usr/bin/env bash
# The whole CPU test suite, from a fresh clone: set-up, lint, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests kernels examples bench
.venv/bin/ruff format --check src tests kernels examples bench
.venv/bin/mypy  # strict, over the torch-free layers listed in pyproject.toml
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
