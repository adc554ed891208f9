#!/usr/bin/env bash
# Everything the device machine checks, in one call: GPU tests, then benchmarks; ends with a short table.
# Usage (on the device machine, repo root): bash bench/gpu_check.sh [w1-only|tests-only|kernels-only]
# Needs the Qwen3 tokenizer in .cache/qwen3-tokenizer (copied from ../shared/models/ and carried).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
# The installed layout without installing: src/asyncllm with top-level kernels/ as asyncllm.kernels.
overlay=$(mktemp -d); cp -r src/asyncllm "$overlay/asyncllm"; cp -r kernels "$overlay/asyncllm/kernels"
export PYTHONPATH="$overlay:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
mode=${1:-all}
rows=()
if [ "$mode" = "all" ] || [ "$mode" = "tests-only" ]; then
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu tests/runner/test_sampler_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  rows+=("gpu tests: $(tail -1 "$OUT/gpu_tests.log")")
  # Triton attention: kernels vs their refs (bf16/fp16/fp32) and the backend vs the torch backend, compiled.
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/kernels tests/attention/test_triton_backend.py 2>&1 \
    | tee "$OUT/triton_tests.log" | tail -15
  rows+=("triton attention tests: $(tail -1 "$OUT/triton_tests.log")")
fi
if [ "$mode" = "all" ] || [ "$mode" = "w1-only" ]; then
  (cd bench && python3 w1_throughput.py --shape qwen3-0.6b --attention-backend torch) 2>&1 | tee "$OUT/w1.log" | tail -3
  rows+=("W1 qwen3-0.6b torch-ref: $(grep '^{' "$OUT/w1.log" | tail -1)")
  (cd bench && python3 w1_throughput.py --shape qwen3-0.6b --attention-backend triton) 2>&1 | tee "$OUT/w1_triton.log" | tail -3
  rows+=("W1 qwen3-0.6b triton: $(grep '^{' "$OUT/w1_triton.log" | tail -1)")
fi
if [ "$mode" = "all" ] || [ "$mode" = "kernels-only" ]; then
  python3 bench/kernels/bench_paged_attention.py 2>&1 | tee "$OUT/bench_paged_attention.log" | tail -4
  rows+=("kernel decode: $(grep '"kernel": "decode"' "$OUT/bench_paged_attention.log" | tail -1)")
  while read -r line; do rows+=("kernel prefill: $line"); done < <(grep '"kernel": "prefill"' "$OUT/bench_paged_attention.log")
fi
echo "================ summary ================"
git log -1 --format='commit %h %cd' 2>/dev/null || true
for r in "${rows[@]}"; do echo "$r"; done
