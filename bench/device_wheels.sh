#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on the device machine (which has torch, triton, transformers, numpy and
# little else): xgrammar for structured output's GPU tests and benches, with what it imports there. Run here,
# before a device call that carries ".whl" (the folder is git-ignored): bash bench/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
get() { python3 -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl "$@"; }
get --no-deps xgrammar==0.2.9 apache-tvm-ffi  # its torch, transformers and numpy are the device's own
get pydantic  # with what it needs (pydantic-core at its pinned version)
# The locked transformers and its tokenizers and hub (constraints.txt), for the start-up steps alone
# (STARTUP_LOCKED=1): the device's image has an older transformers, whose import is slower (bench/RESULTS.md).
mkdir -p .whl/locked && rm -f .whl/locked/*.whl
# The hub's HTTP client (httpx2, httpcore2, truststore, h11, idna: the image has none of them at these versions).
for pkg in transformers tokenizers huggingface_hub httpx2 httpcore2 truststore h11 idna; do
  get --no-deps -d .whl/locked "$(grep -i "^${pkg}==" constraints.txt)"
done
ls -1 .whl .whl/locked
