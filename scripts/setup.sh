#!/usr/bin/env bash
# Idempotent set-up from a fresh clone: a virtualenv in .venv with asyncllm (editable) and its dev tools.
# torch is installed first and pinned to 2.13.0 so pip takes the CPU wheel (a bare `torch` would pull a
# multi-GB CUDA build); on a machine that already has a CUDA torch >= 2.4 in the venv it is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
