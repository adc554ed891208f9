#!/usr/bin/env bash
# The whole CPU test suite, from a fresh clone: set-up, lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "test: ruff (lint and format)" >&2
.venv/bin/ruff check -q src tests kernels examples bench
.venv/bin/ruff format -q --check src tests kernels examples bench
echo "test: mypy (strict, over the files listed in pyproject.toml)" >&2
.venv/bin/mypy
echo "test: pytest" >&2
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
