#!/usr/bin/env bash
# Everything the device machine checks, in one call: GPU tests, then benchmarks; ends with a short table.
# Usage (on the device machine, repo root): bash bench/gpu_check.sh [w1-only|tests-only]
# Needs the Qwen3 tokenizer in .cache/qwen3-tokenizer (copied from ../shared/models/ and carried).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
mode=${1:-all}
rows=()
if [ "$mode" != "w1-only" ]; then
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu tests/runner/test_sampler_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  rows+=("gpu tests: $(tail -1 "$OUT/gpu_tests.log")")
fi
if [ "$mode" != "tests-only" ]; then
  (cd bench && python3 w1_throughput.py --shape qwen3-0.6b --attention-backend torch) 2>&1 | tee "$OUT/w1.log" | tail -3
  rows+=("W1 qwen3-0.6b torch-ref: $(grep '^{' "$OUT/w1.log" | tail -1)")
fi
echo "================ summary ================"
git log -1 --format='commit %h %cd' 2>/dev/null || true
for r in "${rows[@]}"; do echo "$r"; done
