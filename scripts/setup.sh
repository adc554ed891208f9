#!/usr/bin/env bash
# Idempotent set-up from a fresh clone: a virtualenv in .venv with asyncllm (editable) and its dev tools.
# torch is installed first and pinned to 2.13.0 so pip takes the CPU wheel (a bare `torch` would pull a
# multi-GB CUDA build); on a machine that already has a CUDA torch >= 2.4 in the venv it is left alone.
# One line per step on stderr; pip's own output only when a step fails. A second run with the same
# pyproject.toml installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
STAMP=.venv/.asyncllm-setup  # pyproject.toml's hash at the last complete set-up

say() { echo "setup: $*" >&2; }
run() {  # run "what it does" command...: quiet, unless it fails
  say "$1"
  shift
  if ! "$@" >"$LOG" 2>&1; then
    say "failed; its output:"
    cat "$LOG" >&2
    exit 1
  fi
}
PIP=(.venv/bin/python -m pip --disable-pip-version-check)

if [ ! -x .venv/bin/python ]; then
  run "creating the virtualenv .venv ($("$PY" --version 2>&1))" "$PY" -m venv .venv
fi
want=$(.venv/bin/python -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest())")
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x .venv/bin/asyncllm ] &&
  .venv/bin/python -c "import importlib.util as u; assert u.find_spec('asyncllm') and u.find_spec('torch')" 2>/dev/null; then
  say ".venv is up to date"
  exit 0
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  run "installing torch 2.13.0 (large: minutes the first time)" "${PIP[@]}" install "torch==2.13.0"
fi
# `asyncllm` on PyPI is an unrelated project, and this project's name before it became asyncllm-engine: both
# install the module `asyncllm`, so neither may stay beside ours.
if "${PIP[@]}" show asyncllm >/dev/null 2>&1; then
  run "removing the distribution 'asyncllm' (the old name, or the unrelated PyPI project)" "${PIP[@]}" uninstall -y asyncllm
fi
run "installing asyncllm-engine (editable) with its dev tools" "${PIP[@]}" install -e ".[dev]"
echo "$want" >"$STAMP"
say "done: source .venv/bin/activate, then asyncllm --help"
