"""Start-up warm-up: run a few throwaway steps so every Triton kernel a request can launch is compiled (and
cuBLAS, the allocator and the sampler's first calls are paid) before the first request arrives.

Triton compiles per specialisation (dtype, constexprs, argument alignment), not per shape, so one prefill,
one mixed step and eager decodes cover what eager steps launch; CUDA graph capture covers the decode steps.
The throwaway requests write KV into the first blocks only, which no request can read before rewriting.
"""

from __future__ import annotations

import time

import torch

from asyncllm.sample.sampler import load_draw
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import PLACEHOLDER, NewRequestData, ScheduledSeq, SchedulerOutput
from asyncllm.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
_FILTERED = SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True)  # the draw reads float32 logits
_PLAIN = SamplingParams(temperature=0.7, ignore_eos=True)  # the draw reads the model's own logits dtype
_PARAMS = (_GREEDY, _FILTERED, _PLAIN)  # every sampling path and each logits dtype the draw kernel sees


def warm_up(
    runner: ModelRunner,
    *,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> float:
    """Run a prefill step, a mixed prefill + decode step and a decode step, each within the engine's own
    limits (sequences and tokens per step, blocks, length); returns the seconds taken."""
    start = time.perf_counter()
    num_seqs = min(3, max_num_seqs)
    per_step = 2 if num_seqs > 1 else 1  # prompts prefilled together in the first step
    prompt_len = min(
        3 * block_size + 1,  # a few blocks: block-table walks and a tile boundary
        max_model_len - 2,  # room for the decode token
        (num_blocks // num_seqs) * block_size - 1,  # every sequence its own blocks
        (max_num_batched_tokens - 1) // per_step,  # the step's token budget, with a decode beside a prompt
    )
    if prompt_len < 2:
        return time.perf_counter() - start  # too small to warm up within its own limits: the first request compiles
    tables = [_blocks(i, prompt_len + 1, block_size, num_blocks) for i in range(num_seqs)]
    ids = [[(7 * i + j) % 97 for j in range(prompt_len)] for i in range(num_seqs)]
    new = [NewRequestData(f"warmup-{i}", ids[i], _PARAMS[i % len(_PARAMS)], seed=i) for i in range(num_seqs)]
    first = list(range(per_step))
    steps = [SchedulerOutput(seqs=[_seq(i, ids[i], 0, tables[i]) for i in first], new_requests=new[:per_step])]
    if num_seqs == 3:
        # a decode beside a prefill: both attention paths in one step (and the unfiltered draw: greedy + plain)
        mixed = [_seq(0, [1], prompt_len, tables[0]), _seq(2, ids[2], 0, tables[2])]
        steps.append(SchedulerOutput(seqs=mixed, new_requests=new[2:]))
    # decodes only, fed the tokens just sampled on the device as overlapped scheduling does (PLACEHOLDER),
    # padded and planned like a CUDA graph: capture then compiles nothing new
    decoding = list(range(1, num_seqs)) or [0]
    steps.append(SchedulerOutput(seqs=[_seq(i, [PLACEHOLDER], prompt_len, tables[i]) for i in decoding]))
    for step in steps:
        runner.execute_model(step)
    runner.forget([n.request_id for n in new])
    _warm_lm_head(runner)
    _warm_draw(runner)
    return time.perf_counter() - start


@torch.inference_mode()
def _warm_lm_head(runner: ModelRunner) -> None:
    """The LM head runs outside the graphs; cuBLAS sets up a kernel for each new row count on first use
    (a first request paid for it), so every count it runs at is run once: the decode buckets, which every
    step pads its sampled rows to (`Buckets.logit_rows`); without buckets (a backend that cannot be
    captured) a few small counts prefills give."""
    sizes = runner.buckets.decode_sizes or [1, 2, 3, 4, 5, 6, 7, 8]
    weight = next(runner.model.parameters())
    hidden = torch.zeros(sizes[-1], runner.model.arch.hidden_size, dtype=weight.dtype, device=weight.device)
    for size in sizes:
        runner.model.compute_logits(hidden[:size])


@torch.inference_mode()
def _warm_draw(runner: ModelRunner) -> None:
    """The draw kernel compiles a variant per logits dtype it reads: the model's own (plain temperature) and
    float32 (after penalties, filters or stop masks), each with and without a token bitmask (structured
    output). The steps above reach the unmasked two only with three or more sequences (`max_num_seqs`), so
    all four are drawn here, whatever the engine's limits: a first constrained request compiles nothing."""
    weight = next(runner.model.parameters())
    device = weight.device
    hidden = torch.zeros(1, runner.model.arch.hidden_size, dtype=weight.dtype, device=device)
    logits = runner.model.compute_logits(hidden)  # [1, vocab], the model's dtype, as a step's are
    draw = load_draw(device)
    temperature = torch.ones(1, dtype=torch.float32, device=device)
    seeds = torch.zeros(1, dtype=torch.int64, device=device)
    offsets = torch.zeros(1, dtype=torch.int64, device=device)
    bitmask = torch.full((1, -(-logits.shape[1] // 32)), -1, dtype=torch.int32, device=device)  # all allowed
    mask_rows = torch.zeros(1, dtype=torch.int64, device=device)  # int64, as the runner stages them
    for x in (logits, logits.float()):
        draw(x, temperature, seeds, offsets)
        draw(x, temperature, seeds, offsets, bitmask, mask_rows)


def _seq(i: int, tokens: list[int], start: int, blocks: list[int]) -> ScheduledSeq:
    return ScheduledSeq(f"warmup-{i}", tokens, start, blocks, sample=True)


def _blocks(i: int, num_tokens: int, block_size: int, num_blocks: int) -> list[int]:
    per_seq = -(-num_tokens // block_size)
    return [(i * per_seq + j) % num_blocks for j in range(per_seq)]
