"""The engine core's host work per step, on CPU, with no model: scheduling, block accounting and prefix
hashing, output processing, incremental detokenization with the real Qwen3 tokenizer, for 256 sequences
decoding together (a stand-in executor returns tokens at once). The number to keep falling: with
overlapped scheduling it is what must fit inside one device step. Prints one JSON line (median ms/step).
Usage: python bench/host_step.py [--seqs 256] [--steps 200] [--profile]"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

from asyncllm.core.detokenizer import backend_tokenizer
from asyncllm.core.engine_core import EngineCore
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import ModelRunnerOutput, ReadyStep, RuntimeInfo, SchedulerOutput, StepResult

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import find_qwen3_tokenizer


class StandIn:
    """Returns a plausible next token for every sampling sequence at once (text-like ids, never EOS)."""

    def __init__(self, runtime: RuntimeInfo) -> None:
        self.runtime = runtime
        self._rng = random.Random(0)

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        tokens = [self._rng.randrange(1000, 30000) for s in scheduled.seqs if s.sample]
        return ReadyStep(ModelRunnerOutput(tokens))

    def shutdown(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(find_qwen3_tokenizer(), local_files_only=True)
    tokenizer = backend_tokenizer(hf_tokenizer)
    runtime = RuntimeInfo(
        vocab_size=151936,
        max_model_len=4096,
        num_kv_blocks=args.seqs * 4096 // 16,
        block_size=16,
        eos_token_ids=frozenset({151645}),
        device="cpu",
        dtype="bfloat16",
    )
    core = EngineCore(
        StandIn(runtime),
        max_num_seqs=args.seqs,
        max_num_batched_tokens=8192,
        enable_prefix_caching=True,
        seed=0,
        tokenizer=tokenizer,
        clock=time.monotonic,
    )
    inputs = InputProcessor(runtime, lambda s: hf_tokenizer(s).input_ids)
    rng = random.Random(1)
    for i in range(args.seqs):
        prompt = [rng.randrange(0, 10000) for _ in range(rng.randrange(100, 1024))]
        params = SamplingParams(max_tokens=args.steps + 50, ignore_eos=True, stop=["\n\n"] if i % 4 == 0 else None)
        core.add_request(inputs.make_request(f"r{i}", prompt, params, time.monotonic()))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # prefill everything first: the timed steps are all decodes
    profiler = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
        if profiler is not None:
            profiler.disable()
    result = {
        "workload": "host_step",
        "seqs": args.seqs,
        "running": len(core.scheduler.running),
        "ms_per_step_p50": round(1e3 * statistics.median(times), 3),
        "us_per_seq": round(1e6 * statistics.median(times) / args.seqs, 2),
    }
    print(json.dumps(result))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
