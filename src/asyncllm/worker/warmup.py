"""Start-up warm-up: run a few throwaway steps so every Triton kernel a request can launch is compiled (and
cuBLAS, the allocator and the sampler's first calls are paid) before the first request arrives.

Triton compiles per specialisation (dtype, constexprs, argument alignment), not per shape, so one prefill,
one mixed step and eager decodes cover what eager steps launch; CUDA graph capture covers the decode steps.
The throwaway requests write KV into the first blocks only, which no request can read before rewriting.
"""

from __future__ import annotations

import time

from asyncllm.executor.interface import NewRequestData, ScheduledSeq, SchedulerOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
_RANDOM = SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True)


def warm_up(runner: ModelRunner, *, block_size: int, num_blocks: int, max_model_len: int) -> float:
    """Run a prefill step, a mixed prefill + decode step and a decode step; returns the seconds taken."""
    start = time.perf_counter()
    prompt_len = max(2, min(3 * block_size + 1, max_model_len - 2, (num_blocks // 3) * block_size - 1))
    tables = [_blocks(i, prompt_len + 1, block_size, num_blocks) for i in range(3)]
    ids = [[(7 * i + j) % 97 for j in range(prompt_len)] for i in range(3)]
    new = [NewRequestData(f"warmup-{i}", ids[i], _GREEDY if i % 2 == 0 else _RANDOM, seed=i) for i in range(3)]
    steps = [
        # two prompts at once: the prefill kernels over several sequences
        SchedulerOutput(seqs=[_seq(i, ids[i], 0, tables[i]) for i in range(2)], new_requests=new[:2]),
        # a decode beside a prefill: both attention paths in one step
        SchedulerOutput(
            seqs=[_seq(0, [1], prompt_len, tables[0]), _seq(2, ids[2], 0, tables[2])], new_requests=new[2:]
        ),
        # decodes only (eager; graph capture compiles its own)
        SchedulerOutput(seqs=[_seq(i, [1], prompt_len, tables[i]) for i in (1, 2)]),
    ]
    for step in steps:
        runner.execute_model(step)
    runner.forget([n.request_id for n in new])
    return time.perf_counter() - start


def _seq(i: int, tokens: list[int], start: int, blocks: list[int]) -> ScheduledSeq:
    return ScheduledSeq(f"warmup-{i}", tokens, start, blocks, sample=True)


def _blocks(i: int, num_tokens: int, block_size: int, num_blocks: int) -> list[int]:
    per_seq = -(-num_tokens // block_size)
    return [(i * per_seq + j) % num_blocks for j in range(per_seq)]
