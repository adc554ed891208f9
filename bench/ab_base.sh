#!/usr/bin/env bash
# Builds the base tree for `gpu_check.sh ab`: the installed layout (src/asyncllm, with kernels/ inside as
# asyncllm.kernels) of commit REV in .ab/base, with that commit's bench/ beside it (each tree runs its own
# benchmark scripts, which follow its arguments), ignored by git and carried to the device with carry: [".ab"].
# Usage (repo root, here): bash bench/ab_base.sh REV
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bench/ab_base.sh REV}
grep -qx ".ab/" .git/info/exclude 2>/dev/null || echo ".ab/" >> .git/info/exclude
tmp=$(mktemp -d)
git archive "$rev" src/asyncllm kernels bench | tar -x -C "$tmp"
rm -rf .ab/base && mkdir -p .ab/base
mv "$tmp/src/asyncllm" .ab/base/asyncllm && rm -f .ab/base/asyncllm/kernels  # the link to kernels/, if the commit has it
mv "$tmp/kernels" .ab/base/asyncllm/kernels
mv "$tmp/bench" .ab/base/bench && rm -f .ab/base/bench/RESULTS.md
rm -rf "$tmp"
echo "$(git rev-parse --short "$rev")" > .ab/base/REV
echo ".ab/base: $(cat .ab/base/REV)"
