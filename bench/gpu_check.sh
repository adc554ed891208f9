#!/usr/bin/env bash
# Everything the device machine checks, in one call: GPU tests, kernel benchmarks, start-up, then the
# side-by-side with nano-vllm (../shared/peers, copied to .peers and carried); ends with a short table.
# Usage (device machine, repo root): bash bench/gpu_check.sh [STEPS]   STEPS: comma list of
#   tests, kernels, startup, compare (default: all four); decodelayer (issue 45's persistent layer); gguf (GGUF layouts, issue 26); COMPARE_STEPS overrides compare.sh's steps;
#   also w6 (structured output's cost; carry .whl, filled by bench/device_wheels.sh: xgrammar and pydantic), w7 (n=8 samples per prompt against
#   8 separate requests, prefix cache on and off, ~3 min), moe (Qwen3-30B-A3B shape, ~6 min), gemma3 (Gemma 3 4B shape, ~3 min), serve (issue 24, ~6 min), w8 (prompt logprobs), lora (~5 min), quant (~15 min), abpeers (W1+W5 of AB_BASE against this tree, then nano-vllm), enginetests, quicktests, attntests, w12var, w2var, sampling, ab (W1 of AB_BASE against this tree), decodesweep, w1big, gemm, pa, w2ab (W1/W2 under graph and scheduling variants), w1prof (W1 plain + under
#   torch.profiler, ~2 min), w4 (long-context prefill and decode, 16K/32K, two token budgets, ~1 min), and
#   on two GPUs tptests, tpbench (tensor parallelism); wave4 (issues 41/43/44: their GPU tests, spec_oracle,
#   embed_throughput, kv_tiers; EMBED_ARGS / KV_TIERS_ARGS narrow them); spec (issue 41: spec_oracle, W1 with ngram off/on);
#   spec8b (issue 41: EAGLE-3 draft and verify costs, Qwen3-8B shape); kvpace (issue 44: W10 per restore bound, KV_PACE_MIB);
#   kvrestart (issue 44: the restart row with the disk reads in the reader process, then on threads);
#   imports (issue 45: import and open phases under -X importtime); w5fused (issue 45: W5 per decode path, W5_FUSED_ARGS);
#   memcheck (issue 45: the persistent decode layer's tests under compute-sanitizer, where the machine has it).
# Tuning variables (ASYNCLLM_*, docs/tuning.md) pass through to every step: ASYNCLLM_DECODE_PDL=1 bash bench/gpu_check.sh
#   w12var; a variant's bench flags take them as --engine-arg with the lower-case name (cuda_graph_max_tokens=0).
# Set-up here first: rm -rf .peers && cp -r ../shared/peers .peers && cp -r ../shared/models/qwen3-tokenizer .peers/
#   && git describe --always --dirty > .peers/COMMIT   (then carry [".peers"], and ".ab" for the ab step)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
mkdir -p .cache && [ -d .peers/qwen3-tokenizer ] && [ ! -d .cache/qwen3-tokenizer ] && cp -r .peers/qwen3-tokenizer .cache/
# The installed layout without installing: src/asyncllm with top-level kernels/ as asyncllm.kernels.
overlay=$(mktemp -d); cp -r src/asyncllm "$overlay/asyncllm"; rm -f "$overlay/asyncllm/kernels"  # the link to kernels/
cp -r kernels "$overlay/asyncllm/kernels"
# Its bytecode compiled now, as pip does at install: the device sets PYTHONDONTWRITEBYTECODE, so otherwise every
# process compiles the package from source (seconds of every start-up figure).
python3 -m compileall -q "$overlay" >/dev/null
export PYTHONPATH="$overlay:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Wheels carried in .whl (xgrammar and what structured output's tests use), installed beside the overlay.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
steps=${1:-tests,kernels,startup,compare}
rows=()
has() { [[ ",$steps," == *",$1,"* ]]; }
if has tests; then
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu tests/sample/test_sampler_cuda.py \
    tests/kernels tests/attention/test_triton_backend.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|error" | tail -25
  rows+=("gpu tests: $(tail -1 "$OUT/gpu_tests.log")")
fi
if has pytests; then  # chosen GPU tests: PYTEST_SETS, ';'-separated pytest argument lists; names and tracebacks kept
  IFS=';' read -ra sets <<< "${PYTEST_SETS:?set PYTEST_SETS}"
  for set in "${sets[@]}"; do eval "python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -o addopts='' $set" 2>&1 \
    | tee -a "$OUT/pytests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -25; done
  rows+=("gpu tests (chosen): $(grep -E 'passed|failed' "$OUT/pytests.log" | grep -E '^=' | tr '\n' ' ')")
fi
if has memcheck; then  # out-of-bounds reads and writes of the persistent decode layer (its preloads read ahead of
  # their phase, masked: a wrong mask reads outside a tensor and changes no value) under compute-sanitizer
  if command -v compute-sanitizer >/dev/null; then
    timeout 400 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -p no:cacheprovider \
      -o addopts="" tests/gpu/test_decode_layer.py -k "preload or graph" 2>&1 | tee "$OUT/memcheck.log" \
      | grep -E "ERROR SUMMARY|Invalid|passed|failed" | tail -8
    rows+=("memcheck (decode layer): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) $(grep -E 'passed|failed' "$OUT/memcheck.log" | tail -1)")
  else
    rows+=("memcheck: compute-sanitizer not on this machine")
  fi
fi
if has graphtests; then  # the engine-level CUDA-graph tests alone (warm-up, compilation, graphs vs eager)
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu/test_cuda_graphs.py 2>&1 \
    | tee "$OUT/graph_tests.log" | grep -E "passed|failed|Error|error" | tail -15
  rows+=("gpu tests (graphs): $(tail -1 "$OUT/graph_tests.log")")
fi
if has enginetests; then  # the engine-level GPU tests and the sampling kernel (what host-side changes touch)
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu tests/sample/test_sampler_cuda.py \
    tests/kernels/test_sampling.py tests/structured/test_gpu.py 2>&1 | tee "$OUT/engine_tests.log" | grep -E "passed|failed|Error|error" | tail -25
  rows+=("gpu tests (engine): $(tail -1 "$OUT/engine_tests.log")")
fi
if has quicktests; then  # what changed since the full run: engine-level GPU tests and the sampling kernel
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu tests/sample/test_sampler_cuda.py \
    tests/kernels/test_sampling.py tests/kernels/test_paged_attention.py 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|Error|error" | tail -25
  rows+=("gpu tests (quick): $(tail -1 "$OUT/gpu_tests.log")")
fi
if has tptests; then  # tensor parallelism, 2 GPUs (kind nvidia-h200-x2): all-reduce, tests, the ring's step latency
  if [ -z "${TP_TESTS_ONLY:-}" ]; then  # TP_TESTS_ONLY=1: the tests alone, no all-reduce or ring benchmarks
  timeout 90 python3 bench/allreduce_bench.py 2>&1 | tee "$OUT/allreduce.log" | grep -E '^\{|Error|error|Traceback'
  while read -r line; do rows+=("allreduce: $line"); done < <(grep '^{' "$OUT/allreduce.log")
  fi
  # TP_TESTS_K narrows the TP tests (pytest -k), e.g. "not bf16 or qwen3" when the call is short of time.
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu/test_custom_all_reduce.py tests/gpu/test_tp.py \
    -k "${TP_TESTS_K:-}" 2>&1 | tee "$OUT/tp_tests.log" | grep -E "passed|failed|Error|error|agreement" | tail -25
  rows+=("tp tests: $(tail -1 "$OUT/tp_tests.log")")
  if [ -z "${TP_TESTS_ONLY:-}" ]; then
  timeout 100 python3 bench/ring_step_latency.py --messages 3000 --gaps-us 20 --spin-us 1000 2>&1 | tee "$OUT/ring_step.log" | tail -1
  timeout 100 python3 bench/ring_step_latency.py --messages 3000 --gaps-us 2000 2>&1 | tee -a "$OUT/ring_step.log" | tail -1
  while read -r line; do rows+=("ring step: $line"); done < <(grep '^{' "$OUT/ring_step.log")
  fi
fi
if has tpbench; then  # Qwen3-8B shape, TP=1 vs TP=2: W5 and W1 (about 6 minutes)
  timeout 580 python3 bench/tp_bench.py 2>&1 | tee "$OUT/tp_bench.log" | grep -E '^\{|Error'
  while read -r line; do rows+=("tp: $line"); done < <(grep '^{' "$OUT/tp_bench.log")
fi
if has w2ab; then  # W1 and W2 (256 and 16 streams) under graph and scheduling variants, in one call (~4 min)
  cap=max_prefill_tokens_while_decoding
  (cd bench && for v in "" "--engine-arg cuda_graph_max_tokens=0"; do
     timeout 150 python3 w1_throughput.py $v 2>&1 | grep -E '^\{|Error' | tail -2; done
   for v in "" "--engine-arg $cap=512" "--engine-arg $cap=1024"; do
     timeout 150 python3 w2_stream.py $v 2>&1 | grep -E '^\{|Error' | tail -2; done
   timeout 100 python3 w2_stream.py --streams 16 2>&1 | grep -E '^\{|Error' | tail -2
  ) | tee "$OUT/w2ab.log"
  while read -r line; do rows+=("w2ab: $line"); done < <(grep '^{' "$OUT/w2ab.log")
fi
if has w12var; then  # W1 and W2-256 under each variant of W12_VARIANTS: ';'-separated bench flags, ~1.5 min each;
  # W1_FLAGS, W2_FLAGS: flags for w1_throughput.py or w2_stream.py alone (e.g. --host-timing, --lag-trace)
  # Unset: one capped variant; set but empty: the defaults alone (a single space works the same). Defaults
  # differ by entry point: W1 (LLM) gives prompts the whole step, W2 (AsyncLLMEngine) caps them at 2048.
  spec=${W12_VARIANTS-"--engine-arg max_prefill_tokens_while_decoding=1024"}
  (cd bench && IFS=';' read -ra variants <<< "${spec:- }"
   for v in "${variants[@]}"; do
     timeout 150 python3 w1_throughput.py $v ${W1_FLAGS:-} 2>&1 | grep -E '^\{|Error' | tail -2
     timeout 150 python3 w2_stream.py $v ${W2_FLAGS:-} 2>&1 | grep -E '^\{|Error' | tail -2; done
  ) | tee "$OUT/w12var.log"
  while read -r line; do rows+=("w12var: $line"); done < <(grep '^{' "$OUT/w12var.log")
fi
if has w2var; then  # W2-256 alone under each of W2_VARIANTS (';'-separated w2_stream.py flags; empty: defaults)
  (cd bench && IFS=';' read -ra variants <<< "${W2_VARIANTS:- }"
   for v in "${variants[@]}"; do timeout 150 python3 w2_stream.py $v 2>&1 | grep -E '^\{|Error' | tail -2; done
  ) | tee "$OUT/w2var.log"
  while read -r line; do rows+=("w2var: $line"); done < <(grep '^{' "$OUT/w2var.log")
fi
if has sampling; then  # the Gumbel-max draw's launch shapes at 256, 64 and 1 rows (bench/kernels/bench_sampling.py)
  timeout 150 python3 bench/kernels/bench_sampling.py 2>&1 | tee "$OUT/bench_sampling.log" | grep -E 'best|error|Error'
  rows+=("sampling: $(grep '"best"' "$OUT/bench_sampling.log")")
fi
if has ab; then  # W1 (or AB_BENCH, e.g. w6_structured.py, with AB_ARGS) of a base tree (AB_BASE: an installed-layout
  # copy with its own bench/, carried; bench/ab_base.sh REV makes it) against this one, alternating, AB_ROUNDS times
  base=${AB_BASE:-.ab/base}; root=$PWD
  for d in .cache .peers; do [ -e "$base/$d" ] || ln -s "$root/$d" "$base/$d"; done  # where its scripts look
  for i in $(seq "${AB_ROUNDS:-2}"); do for tree in base new; do
    if [ $tree = base ]; then
      pp="$root/$base:$PYTHONPATH" dir="$root/$base/bench"; [ -d "$dir" ] || dir=$root/bench
    else
      pp=$PYTHONPATH dir=$root/bench
    fi
    echo -n "$tree$([ $tree = base ] && [ -f "$base/REV" ] && echo "@$(cat "$base/REV")") "
    (cd "$dir" && PYTHONPATH=$pp timeout "${AB_TIMEOUT:-150}" python3 "${AB_BENCH:-w1_throughput.py}" ${AB_ARGS:-} 2>&1 \
      | grep -E '^\{|Error' | tail -1)
  done; done | tee "$OUT/ab.log"
  while read -r line; do rows+=("ab: $line"); done < <(grep '{' "$OUT/ab.log" | cut -c1-300)
fi
if has abpeers; then  # W1 and W5 through the peers' w1_w5.py (same checkpoint as compare.sh) for a base tree
  # (AB_BASE, carried; bench/ab_base.sh REV makes it) and this one, alternating AB_ROUNDS times, then nano-vllm once
  base=${AB_BASE:-.ab/base}; ck=/tmp/peers-q0.6b
  [ -d $ck ] || python3 .peers/make_model.py 0.6b $ck .peers/qwen3-tokenizer >/dev/null 2>&1
  ov=$(echo "$PYTHONPATH" | cut -d: -f1)
  for i in $(seq "${AB_ROUNDS:-2}"); do for tree in base new; do
    if [ $tree = base ]; then pp="$PWD/$base"; else pp=$ov; fi
    PYTHONPATH=$pp timeout 240 python3 .peers/w1_w5.py asyncllm $ck 2>&1 | grep -E "RESULT|Error" | sed "s/^/$tree /"
  done; done | tee "$OUT/abpeers.log"
  [ -n "${AB_NV:-1}" ] && PYTHONPATH=$PWD/.peers timeout 300 python3 .peers/w1_w5.py nanovllm $ck 2>&1 \
    | grep -E "RESULT|Error" | sed "s/^/nano-vllm /" | tee -a "$OUT/abpeers.log"
  while read -r line; do rows+=("abpeers: $line"); done < <(grep RESULT "$OUT/abpeers.log")
fi
if has w6; then  # issue 21: W1-style and batch-1 throughput with a JSON schema on every request against none
  (cd bench && timeout 300 python3 w6_structured.py 2>&1 | grep -E '^\{|Error|Traceback' | tail -3) | tee "$OUT/w6.log"
  rows+=("w6: $(grep '^{' "$OUT/w6.log" | tail -1)")
  (cd bench && timeout 120 python3 w6_host.py 2>&1 | grep -E '^\{|Error|Traceback' | tail -3) | tee "$OUT/w6host.log"
  rows+=("w6 host: $(grep '^{' "$OUT/w6host.log" | tail -1)")
fi
if has w7; then  # issue 22: 32 W1 prompts x n=8 as one request each against 256 separate requests, same tokens
  (cd bench && timeout 500 python3 w7_n_samples.py 2>&1 | grep -E '^\{|Error|Traceback' | tail -3) | tee "$OUT/w7.log"
  rows+=("w7: $(grep '^{' "$OUT/w7.log" | tail -1)")
fi
if has w8; then  # issue 22: prompt logprobs (scoring) against plain prefill of the same prompts
  (cd bench && timeout 300 python3 w8_prompt_logprobs.py 2>&1 | grep -E '^\{|Error|Traceback' | tail -3) | tee "$OUT/w8.log"
  rows+=("w8: $(grep '^{' "$OUT/w8.log" | tail -1)")
fi
if has lora; then  # issue 27: LoRA kernels and GPU tests, the kernels against their GEMMs, W1 with 8 adapters mixed vs the base (~5 min)
  [ -z "${LORA_BENCH_ONLY:-}" ] && python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/kernels/test_lora.py \
    tests/gpu/test_lora.py 2>&1 | tee "$OUT/lora_tests.log" | tail -3  # LORA_BENCH_ONLY=1: the benchmarks alone
  timeout 120 python3 bench/kernels/bench_lora.py | tee "$OUT/bench_lora.jsonl" | tail -4
  timeout 300 python3 bench/w1_lora.py | tee "$OUT/w1_lora.json" | tail -2
  rows+=("lora tests: $(tail -1 "$OUT/lora_tests.log" 2>/dev/null)" "W1 LoRA: $(tail -1 "$OUT/w1_lora.json" | cut -c1-240)")
fi
if has quant; then  # issue 26: quantized weights' GPU tests, GEMM paths per shape and size, W5/W1 bf16 vs FP8 vs int4 beside nano-vllm
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/gpu/test_quant.py tests/kernels/test_quant_matmul.py tests/kernels/test_quant_matmul_gemv.py 2>&1 | tee "$OUT/quant_tests.log" | grep -E "passed|failed|Error|perplexity" | tail -20
  rows+=("quant tests: $(tail -1 "$OUT/quant_tests.log")")
  timeout 240 python3 bench/kernels/bench_quant_matmul.py --m 1 4 16 2048 2>&1 | tee "$OUT/quant_kernels.log" | grep -E '"summary"|Error'
  for s in qwen3-0.6b qwen3-8b; do timeout 400 python3 bench/quant_bench.py --shapes $s --peers 2>&1 | grep -E '^\{|Error'; done | tee "$OUT/quant_bench.log"
  while read -r line; do rows+=("quant: $line"); done < <(grep '"W5"\|"W1"' "$OUT/quant_bench.log")
fi
if has gguf; then  # issue 26: GGUF layouts (Q8_0 .. Q6_K, float16 against float32 K-quant scales) through the
  # quantized layer's paths against bf16 at decode sizes, Qwen3-8B shapes
  timeout 240 python3 bench/kernels/bench_gguf_layouts.py 2>&1 | tee "$OUT/gguf_layouts.log" | grep -E '^\{|Error'
  while read -r line; do rows+=("gguf: $(echo "$line" | cut -c1-200)"); done < <(grep '^{' "$OUT/gguf_layouts.log")
fi
if has gemma3; then  # issue 27: Gemma 3 4B shape (random weights): W5 and W1 beside their byte-count limits (~3 min)
  timeout 580 python3 bench/gemma3_w1_w5.py 2>&1 | tee "$OUT/gemma3.log" | grep -E '^\{|Error'
  while read -r line; do rows+=("gemma3: $line"); done < <(grep '^{' "$OUT/gemma3.log")
fi
if has serve; then  # issue 24: the HTTP server against the in-process engine, step thread and --core-process (~6 min;
  # carry .whl with fastapi, uvicorn, prometheus_client, httpx)
  for flags in "--server-flags=--no-core-process" ""; do
    (cd bench && timeout 280 python3 serve_load.py --shape qwen3-0.6b --device cuda --requests-per-stream 4 $flags 2>&1 \
      | grep -E '^\{|ratio|Error|Traceback' | tail -6) | tee -a "$OUT/serve_load.log"
  done
  while read -r line; do rows+=("serve: $(echo "$line" | cut -c1-240)"); done < <(grep -E 'ratio' "$OUT/serve_load.log")
fi
if has moe; then  # issue 27: fused MoE experts (TP=1, a TP=2 slice), then W5 and W1 on the Qwen3-30B-A3B shape (~6 min)
  timeout 180 python3 bench/kernels/bench_fused_moe.py 2>&1 | tee "$OUT/bench_fused_moe.log" | tail -6
  timeout 120 python3 bench/kernels/bench_fused_moe.py --tp 2 2>&1 | tee -a "$OUT/bench_fused_moe.log" | tail -6
  while read -r line; do rows+=("moe kernel: $(echo "$line" | cut -c1-200)"); done < <(grep '^{' "$OUT/bench_fused_moe.log")
  (cd bench && timeout 540 python3 moe_bench.py 2>&1 | grep -E '^\{|Error' | tail -3) | tee "$OUT/moe.log"
  while read -r line; do rows+=("qwen3-30b-a3b: $(echo "$line" | cut -c1-260)"); done < <(grep '^{' "$OUT/moe.log")
fi
if has w1big; then  # W1 on the Qwen3-8B shape (limit 13,000 tok/s)
  (cd bench && timeout 150 python3 w1_throughput.py --shape qwen3-8b 2>&1 | grep -E '^\{|Error' | tail -1) | tee "$OUT/w1big.log"
  rows+=("w1 8b: $(grep '{' "$OUT/w1big.log" | cut -c1-220)")
fi
if has decodesweep; then  # decode attention variants at W1-like lengths (batch 256, context U[200, 2048])
  timeout 120 python3 bench/kernels/bench_paged_attention.py --decode-only --min-context 200 --context 2048 2>&1 \
    | tee "$OUT/decode_sweep.log" | grep -E '"kernel": "decode"|Error'
  rows+=("decode sweep: $(grep '"kernel": "decode"' "$OUT/decode_sweep.log" | tail -1)")
fi
if has attntests; then  # the attention kernels and backend against the reference (graph-shaped launches too)
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/kernels/test_paged_attention.py \
    tests/attention/test_triton_backend.py 2>&1 | tee "$OUT/attn_tests.log" | grep -E "passed|failed|Error|error" | tail -15
  rows+=("gpu tests (attention): $(tail -1 "$OUT/attn_tests.log")")
fi
if has pa; then  # the paged-attention micro-benchmark alone (its launch variants)
  timeout 120 python3 bench/kernels/bench_paged_attention.py 2>&1 | tee "$OUT/bench_paged_attention.log" | tail -4
  rows+=("kernel decode: $(grep '"kernel": "decode"' "$OUT/bench_paged_attention.log" | tail -1)")
fi
if has gemm; then
  timeout 120 python3 bench/kernels/bench_gemm.py 2>&1 | tee "$OUT/bench_gemm.log" | tail -3
  while read -r line; do rows+=("gemm: $line"); done < <(grep '^{' "$OUT/bench_gemm.log")
fi
if has kernels; then
  timeout 240 python3 bench/kernels/bench_fused.py --models qwen3-0.6b --tokens 1 64 2048 2>&1 | tee "$OUT/bench_fused.log" | tail -12
  while read -r line; do rows+=("fused: $line"); done < <(grep '^{' "$OUT/bench_fused.log" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); print({k: d[k] for k in d if k in ("kernel", "tokens", "eager_us", "compiled_us", "triton_us", "winner", "triton_pct_of_copy_bw")})')
  timeout 120 python3 bench/kernels/bench_paged_attention.py 2>&1 | tee "$OUT/bench_paged_attention.log" | tail -4
  rows+=("kernel decode: $(grep '"kernel": "decode"' "$OUT/bench_paged_attention.log" | tail -1)")
fi
if has w1prof; then  # where W1's wall time goes (issue 9); the key_averages table lands in $OUT
  (cd bench && OUT="$OUT" timeout 300 python3 w1_profile.py --shape qwen3-0.6b) 2>&1 | tee "$OUT/w1_profile.log" \
    | grep -E '^\{|Error|Traceback'
  while read -r line; do rows+=("w1prof: $line"); done < <(grep '^{' "$OUT/w1_profile.log")
fi
if has w4; then  # long context: prefill tok/s vs the compute limit, decode ms/token, chunked vs one chunk
  (cd bench && timeout 240 python3 w4_prefill.py --shape qwen3-0.6b --profile) 2>&1 | tee "$OUT/w4.log" | grep -E '^\{|Error|Traceback'
  while read -r line; do rows+=("w4: $line"); done < <(grep '^{' "$OUT/w4.log")
fi
# STARTUP_LOCKED=1: the start-up and imports steps run the locked transformers, tokenizers and hub (constraints.txt;
# bench/device_wheels.sh puts them in .whl/locked), not the image's older ones.
locked=()
if [ -n "${STARTUP_LOCKED:-}" ] && compgen -G ".whl/locked/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-locked .whl/locked/*.whl \
    && locked=(PYTHONPATH="/tmp/site-locked:$PYTHONPATH")
fi
if has startup; then  # twice: the machine's first run fills Triton's cache, the second starts warm (STARTUP_ARGS
  # go to the second, e.g. --profile 40)
  # STARTUP_PYCACHE=1: Python keeps bytecode (in /tmp/pycache), as an installed package's imports read it.
  if [ -n "${STARTUP_PYCACHE:-}" ]; then py=(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pycache "${locked[@]}" python3); else py=(env "${locked[@]}" python3); fi
  # STARTUP_WARM_RUNS=N: N warm runs (second, third, ...): this device's phases moved by a second between runs
  runs=(first second); for ((i = 2; i <= ${STARTUP_WARM_RUNS:-1}; i++)); do runs+=("warm$i"); done
  for run in "${runs[@]}"; do
    [ $run != first ] && extra=${STARTUP_ARGS:-} || extra=
    (cd bench && timeout 200 "${py[@]}" startup.py --shape qwen3-0.6b $extra) 2>&1 | tee "$OUT/startup_$run.log" | grep "^{" | tail -1
    rows+=("startup ($run run): $(grep '^{' "$OUT/startup_$run.log" | tail -1)")
  done
fi
if has imports; then  # issue 45: where start-up's import and open phases go (-X importtime of torch + open_checkpoint)
  # As the device runs Python (PYTHONDONTWRITEBYTECODE: no bytecode written), then twice with bytecode kept in a
  # cache (the first run fills it): an installed package's imports read bytecode pip wrote.
  python3 -c "import torch, transformers, os; print('bytecode beside torch / transformers:', *(os.path.isdir(os.path.join(os.path.dirname(m.__file__), '__pycache__')) for m in (torch, transformers)), 'PYTHONDONTWRITEBYTECODE=' + os.environ.get('PYTHONDONTWRITEBYTECODE', ''))"
  for run in plain fill cached; do
    if [ $run = plain ]; then envs=(env "${locked[@]}"); else envs=(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pycache "${locked[@]}"); fi
    (cd bench && timeout 120 "${envs[@]}" python3 open_imports.py --shape qwen3-0.6b) 2>&1 | tee "$OUT/open_imports_$run.log" \
      | grep -E '^\{|Error|Traceback' | cut -c1-700
    rows+=("imports ($run): $(grep '^{' "$OUT/open_imports_$run.log" | tail -1 | cut -c1-240)")
  done
fi
if has wave4; then  # issues 41, 43, 44 on the card: their GPU tests, then speculation's ceiling, embeddings, KV tiers
  python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -o addopts="" tests/gpu/test_bert.py tests/gpu/test_pooling.py \
    tests/gpu/test_kv_tiers.py tests/kernels/test_varlen_attention.py 2>&1 | tee "$OUT/wave4_tests.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed" | tail -15
  rows+=("wave4 tests: $(tail -1 "$OUT/wave4_tests.log")")
  (cd bench && timeout 240 python3 spec_oracle.py --shape qwen3-0.6b --k 4 --tokens 256) 2>&1 | tee "$OUT/spec.log" | grep -E '^\{|Error' | tail -3
  rows+=("spec oracle: $(grep '^{' "$OUT/spec.log" | tail -1)")
  (cd bench && timeout "${EMBED_TIMEOUT:-240}" python3 embed_throughput.py ${EMBED_ARGS:-}) 2>&1 | tee "$OUT/embed.log" | grep -E '^\{|Error' | tail -4
  while read -r line; do rows+=("embed: $line"); done < <(grep '^{' "$OUT/embed.log")
  (cd bench && timeout "${KV_TIERS_TIMEOUT:-300}" python3 kv_tiers.py ${KV_TIERS_ARGS:-}) 2>&1 | tee "$OUT/kv_tiers.log" | grep -E '^\{|Error' | tail -6
  while read -r line; do rows+=("kv tiers: $line"); done < <(grep '^{' "$OUT/kv_tiers.log")
fi
if has spec; then  # issue 41: speculation's ceiling at batch 1 (spec_oracle) and its cost at 256 streams (W1, ngram off/on)
  (cd bench && timeout 240 python3 spec_oracle.py --shape qwen3-0.6b --k 4 --tokens 256) 2>&1 | tee "$OUT/spec.log" | grep -E '^\{|Error' | tail -3
  rows+=("spec oracle: $(grep '^{' "$OUT/spec.log" | tail -1)")
  for round in $(seq "${SPEC_ROUNDS:-2}"); do  # SPEC_ROUNDS: rounds of W1 off / on (default 2)
    for mode in off ngram; do
      extra=(); [ "$mode" = ngram ] && extra=(--engine-arg 'speculative_config={"method": "ngram", "num_speculative_tokens": 4}')
      (cd bench && timeout 150 python3 w1_throughput.py "${extra[@]}") 2>&1 | tee -a "$OUT/spec_w1.log" | grep -E '^\{|Error' | tail -2
      rows+=("W1 256 streams, speculation $mode (round $round): $(grep '^{' "$OUT/spec_w1.log" | tail -1 | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["output_tok_per_s"], "tok/s")')")
    done
  done
fi
if has kvtiers; then  # issue 44: W10 and the disk tier alone (KV_TIERS_ARGS narrows them, e.g. --conversations 16 --turns 4)
  (cd bench && timeout "${KV_TIERS_TIMEOUT:-300}" python3 kv_tiers.py ${KV_TIERS_ARGS:-}) 2>&1 | tee "$OUT/kv_tiers.log" | grep -E '^\{|Error|Traceback' | tail -6
  while read -r line; do rows+=("kv tiers: $line"); done < <(grep '^{' "$OUT/kv_tiers.log")
fi
if has kvrestart; then  # issue 44's restart row per disk reader (KV_RESTART_READERS, default "process threads") and
  # reader thread count (KV_RESTART_THREADS, default "": the engine's own), with traces
  for reader in ${KV_RESTART_READERS:-process threads}; do
    for threads in ${KV_RESTART_THREADS:-default}; do
      log="$OUT/kv_restart_${reader}_$threads.log" count=()
      [ "$threads" != default ] && count=(ASYNCLLM_KV_DISK_LOAD_THREADS=$threads)
      (cd bench && env "${count[@]}" ASYNCLLM_KV_DISK_READER=$reader timeout 200 python3 kv_tiers.py --parts disk --trace) \
        2>&1 | tee "$log" | grep -E '^\{|Error|Traceback' | tail -3
      rows+=("restart, reads by $reader ($threads threads): $(grep -o '"disk_ttft_over_cold": [0-9.]*' "$log")")
    done
  done
fi
if has decodelayer; then  # issue 45: the persistent decode layer's and the PDL GEMVs' GPU tests (DECODE_LAYER_TESTS=0: none), then its
  # bench against the engine's chain (DECODE_LAYER_ARGS: the bench's flags; DECODE_LAYER_ARGS2: a second run's)
  if [ "${DECODE_LAYER_TESTS:-1}" != 0 ]; then
    timeout 300 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -o addopts='' tests/gpu/test_decode_layer.py \
      tests/kernels/test_gemv_prologue.py -k gpu 2>&1 | tee "$OUT/decode_layer_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -12
    rows+=("decode layer tests: $(grep -E 'passed|failed' "$OUT/decode_layer_tests.log" | tail -1)")
  fi
  timeout 240 python3 bench/kernels/bench_decode_layer.py ${DECODE_LAYER_ARGS:-} 2>&1 | tee "$OUT/decode_layer.log" \
    | grep -E '^\{|Error|error' | tail -20
  [ -n "${DECODE_LAYER_ARGS2:-}" ] && timeout 240 python3 bench/kernels/bench_decode_layer.py $DECODE_LAYER_ARGS2 2>&1 \
    | tee -a "$OUT/decode_layer.log" | grep -E '^\{|Error|error' | tail -20
  while read -r line; do rows+=("decode layer: $line"); done < <(grep '^{' "$OUT/decode_layer.log")
fi
if has w5fused; then  # issue 45: W5 per decode path in one process (W5_FUSED_ARGS: w5_fused.py's flags, e.g. --modes)
  (cd bench && timeout 300 python3 w5_fused.py ${W5_FUSED_ARGS:-}) 2>&1 | tee "$OUT/w5_fused.log" | grep -E '^\{|Error|Traceback' | tail -12
  while read -r line; do rows+=("w5 fused: $line"); done < <(grep '^{' "$OUT/w5_fused.log")
fi
if has kvpace; then  # issue 44: W10 off and on, then on again per ASYNCLLM_KV_RESTORE_MIB_PER_STEP in KV_PACE_MIB (KV_PACE_ARGS: more flags)
  kinds=off,on; [ "${KV_PACE_OFF:-1}" = 0 ] && kinds=on  # KV_PACE_OFF=0: no "off" run (an earlier one stands)
  (cd bench && timeout 330 python3 kv_tiers.py --parts w10 --kinds $kinds ${KV_PACE_ARGS:-}) 2>&1 | tee "$OUT/kvpace.log" | grep -E '^\{|Error|Traceback' | tail -3
  rows+=("W10 $kinds, no restore bound: $(grep '^{' "$OUT/kvpace.log" | tail -1)")
  for mib in ${KV_PACE_MIB:-1024}; do
    (cd bench && ASYNCLLM_KV_RESTORE_MIB_PER_STEP=$mib timeout 200 python3 kv_tiers.py --parts w10 --kinds on ${KV_PACE_ARGS:-}) 2>&1 \
      | tee "$OUT/kvpace_$mib.log" | grep -E '^\{|Error|Traceback' | tail -3
    rows+=("W10 on, restores <= $mib MiB a step: $(grep '^{' "$OUT/kvpace_$mib.log" | tail -1)")
  done
fi
if has spec8b; then  # issue 41: EAGLE-3's draft and verify costs on the Qwen3-8B shape (a random head; ~3 min)
  (cd bench && timeout 300 python3 spec_eagle3.py --shape qwen3-8b --k 3) 2>&1 | tee "$OUT/spec8b.log" | grep -E '^\{|Error|Traceback' | tail -3
  rows+=("spec eagle3 8b: $(grep '^{' "$OUT/spec8b.log" | tail -1)")
fi
if has compare; then
  # compare.sh copies $PROJ/src/asyncllm, whose kernels/ is a link here: hand it the overlay's layout instead.
  proj=$(mktemp -d) && mkdir "$proj/src" && cp -r "$overlay/asyncllm" "$proj/src/asyncllm"
  PROJ=$proj timeout 420 bash .peers/compare.sh 0.6b "${COMPARE_STEPS:-nv,al,w2s,prof}" 2>&1 | tee "$OUT/compare.log" | grep -E "RESULT|Error|B=|Self CUDA|Self CPU" | tail -20
  while read -r line; do rows+=("compare: $line"); done < <(grep RESULT "$OUT/compare.log")
fi
echo "================ summary ================"
# The device copy's .git may be stale: the set-up line writes the commit sent into .peers/COMMIT (plus a
# mark when the tree had uncommitted changes).
if [ -f .peers/COMMIT ]; then echo "commit sent: $(cat .peers/COMMIT)"
else git log -1 --format="commit %h %cd (the device copy's .git: may be stale)" 2>/dev/null || true; fi
for r in "${rows[@]}"; do echo "$r"; done
