#!/usr/bin/env bash
# Idempotent set-up from a fresh clone: a virtualenv with asyncllm (editable).
#
#   scripts/setup.sh             .venv: the engine and what it runs (the main job), at the locked versions
#   scripts/setup.sh --dev       .venv: the same plus the test tools (the `dev` extra), at the locked versions
#   scripts/setup.sh --latest    .venv-latest: the newest versions pyproject.toml allows, the lock ignored
#                                (what `pip install asyncllm-engine` users get); combine with --dev
#
# The lock is constraints.txt (docs/install.md says why a pip constraints file; scripts/lock.sh refreshes it).
# torch is installed first and pinned to 2.13.0 so pip takes the CPU wheel on disk (a bare `torch` would pull
# a multi-GB CUDA build); a torch already in the venv (a CUDA build on a GPU machine) is left alone, under
# --latest too. One line per step on stderr; pip's own output only when a step fails. A second run with the
# same pyproject.toml and lock installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.13.0
dev=0 latest=0
for arg in "$@"; do
  case $arg in
  --dev) dev=1 ;;
  --latest) latest=1 ;;
  *)
    echo "setup: unknown option $arg (expected --dev, --latest)" >&2
    exit 2
    ;;
  esac
done
VENV=.venv
[ $latest = 1 ] && VENV=.venv-latest
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

say() { echo "setup: $*" >&2; }
run() { # run "what it does" command...: quiet, unless it fails
  say "$1"
  shift
  if ! "$@" >"$LOG" 2>&1; then
    say "failed; its output:"
    cat "$LOG" >&2
    exit 1
  fi
}
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
  run "creating the virtualenv $VENV ($("$PY" --version 2>&1))" "$PY" -m venv "$VENV"
fi
STAMP=$VENV/.asyncllm-setup # what the last complete set-up installed: inputs' hash, then "dev" or "run"
want=$(cat pyproject.toml constraints.txt | "$VENV/bin/python" -c "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
have=$(cat "$STAMP" 2>/dev/null || true)
if [ $latest = 0 ] && [ -x "$VENV/bin/asyncllm" ] && { [ "$have" = "$want dev" ] || [ "$have" = "$want run" -a $dev = 0 ]; } &&
  "$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('asyncllm') and u.find_spec('torch')" 2>/dev/null; then
  say "$VENV is up to date"
  exit 0
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  run "installing torch $TORCH (large: minutes the first time)" "${PIP[@]}" install "torch==$TORCH"
fi
# `asyncllm` on PyPI is an unrelated project, and this project's name before it became asyncllm-engine: both
# install the module `asyncllm`, so neither may stay beside ours.
if "${PIP[@]}" show asyncllm >/dev/null 2>&1; then
  run "removing the distribution 'asyncllm' (the old name, or the unrelated PyPI project)" "${PIP[@]}" uninstall -y asyncllm
fi
target=. what="the engine"
[ $dev = 1 ] && target=".[dev]" what="the engine and its test tools"
# Whatever torch is installed stays: the lock does not name it, and --latest holds it where it is.
HOLD=$(mktemp)
trap 'rm -f "$LOG" "$HOLD"' EXIT
"$VENV/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >"$HOLD"
if [ $latest = 1 ]; then
  run "installing asyncllm-engine (editable): $what, the newest versions allowed" \
    "${PIP[@]}" install --upgrade --upgrade-strategy eager -c "$HOLD" -e "$target"
  "${PIP[@]}" freeze --exclude-editable | grep -E -i '^(transformers|tokenizers|kernels|xgrammar|torch)==' |
    tr '\n' ' ' | sed 's/^/setup: resolved: /;s/ $/\n/' >&2
else
  run "installing asyncllm-engine (editable): $what, the versions in constraints.txt" \
    "${PIP[@]}" install -c constraints.txt -c "$HOLD" -e "$target"
  echo "$want $([ $dev = 1 ] && echo dev || echo run)" >"$STAMP"
fi
say "done: source $VENV/bin/activate, then asyncllm --help"
