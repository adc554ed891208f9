#!/usr/bin/env bash
# The CPU test suite, from a fresh clone: set-up, lint, types, tests. CI runs it (.ci/run).
#
#   scripts/test.sh            everything, at the locked versions (constraints.txt), in .venv
#   scripts/test.sh --latest   everything, at the newest versions pyproject.toml allows, in .venv-latest
#   scripts/test.sh --quick    the inner loop: lint and the tests not marked `slow` (no mypy)
#
# Other arguments go to pytest (`scripts/test.sh tests/core -k block`). pytest runs one worker per core
# (pytest-xdist; `-n 1` runs on one), and mypy beside it: the workers wait on processes they start.
set -euo pipefail
cd "$(dirname "$0")/.."
setup=(--dev) venv=.venv quick=0 args=()
for arg in "$@"; do
  case $arg in
  --latest) setup+=(--latest) venv=.venv-latest ;;
  --quick) quick=1 ;;
  *) args+=("$arg") ;;
  esac
done
scripts/setup.sh "${setup[@]}"
# Every engine, core and worker process the tests start imports the package: compiled once, not per process
# (__pycache__ is ignored by git).
unset PYTHONDONTWRITEBYTECODE
start=$SECONDS
echo "test: ruff (lint and format)" >&2
"$venv/bin/ruff" check -q src tests kernels examples bench
"$venv/bin/ruff" format -q --check src tests kernels examples bench
marks=() mypy_log=$(mktemp)
trap 'rm -f "$mypy_log"' EXIT
if [ $quick = 0 ]; then
  echo "test: mypy (strict, over the files listed in pyproject.toml), beside pytest" >&2
  "$venv/bin/mypy" >"$mypy_log" 2>&1 &
  mypy_pid=$!
else
  marks=(-m "not slow and not gpu")
fi
echo "test: pytest" >&2
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadgroup "${marks[@]}" "${args[@]}" || status=$?
if [ $quick = 0 ]; then
  if ! wait "$mypy_pid"; then
    echo "test: mypy failed:" >&2
    cat "$mypy_log" >&2
    status=1
  fi
fi
echo "test: $((SECONDS - start)) s after set-up" >&2
exit $status
