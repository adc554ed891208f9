"""The runner feeds a PLACEHOLDER input from the previous step's sampled ids, on the device: decoding with
placeholders (overlapped scheduling's steps, planned before the previous token is known) gives the same
tokens as feeding every token explicitly."""

from __future__ import annotations

import torch

from asyncllm.config import EngineConfig
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import PLACEHOLDER, NewRequestData, ScheduledSeq, SchedulerOutput
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.setup import build_worker


def _runner(path):
    config = EngineConfig.from_kwargs(str(path), device="cpu", num_kv_blocks=32, block_size=4)
    checkpoint = open_checkpoint(str(path), torch.float32)
    worker = build_worker(config, checkpoint, ResolvedModel.resolve(config, checkpoint.hf_config))
    assert worker.runner is not None
    return worker.runner


def _decode(runner, prompts: list[list[int]], steps: int, placeholders: bool) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=5)]
    tables = [[2 * i, 2 * i + 1, 10 + 2 * i, 11 + 2 * i] for i in range(len(prompts))]
    new = [NewRequestData(f"r{i}", p, params[i % 2], seed=i) for i, p in enumerate(prompts)]
    seqs = [ScheduledSeq(f"r{i}", p, 0, tables[i], True) for i, p in enumerate(prompts)]
    out = runner.submit(SchedulerOutput(seqs=seqs, new_requests=new))
    tokens = [[t] for t in out.result().sampled_token_ids]
    for _ in range(steps):
        seqs = [
            ScheduledSeq(
                f"r{i}", [PLACEHOLDER if placeholders else tokens[i][-1]], len(p) + len(tokens[i]) - 1, tables[i], True
            )
            for i, p in enumerate(prompts)
        ]
        out = runner.submit(SchedulerOutput(seqs=seqs))
        for seq_tokens, token in zip(tokens, out.result().sampled_token_ids):
            seq_tokens.append(token)
    runner.forget([f"r{i}" for i in range(len(prompts))])
    return tokens


def test_placeholders_equal_explicit_tokens(tiny_model) -> None:
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    explicit = _decode(_runner(tiny_model), prompts, steps=6, placeholders=False)
    fed = _decode(_runner(tiny_model), prompts, steps=6, placeholders=True)
    assert fed == explicit and len(fed[0]) == 7


def test_placeholder_after_a_skipped_step_takes_that_requests_own_latest_token(tiny_model) -> None:
    """Regression: placeholders were filled from the previous step's output rows; a decode starved of token
    budget for one step (another request's chunk took it) then read another request's token, or none."""
    runner = _runner(tiny_model)
    greedy = SamplingParams(temperature=0.0)
    new = [NewRequestData("a", [5, 6, 7], greedy, seed=0), NewRequestData("b", [9, 8], greedy, seed=1)]
    first = runner.execute_model(
        SchedulerOutput(
            seqs=[ScheduledSeq("a", [5, 6, 7], 0, [0, 1], True), ScheduledSeq("b", [9, 8], 0, [4, 5], True)],
            new_requests=new,
        )
    )
    a_token, b_token = first.sampled_token_ids
    # b decodes alone (a starved), then a decodes with a placeholder: it must get its own token back.
    runner.execute_model(SchedulerOutput(seqs=[ScheduledSeq("b", [PLACEHOLDER], 2, [4, 5], True)]))
    fed = runner.execute_model(SchedulerOutput(seqs=[ScheduledSeq("a", [PLACEHOLDER], 3, [0, 1], True)]))
    other = _runner(tiny_model)
    other.execute_model(SchedulerOutput(seqs=[ScheduledSeq("a", [5, 6, 7], 0, [0, 1], True)], new_requests=new[:1]))
    explicit = other.execute_model(SchedulerOutput(seqs=[ScheduledSeq("a", [a_token], 3, [0, 1], True)]))
    assert fed.sampled_token_ids == explicit.sampled_token_ids
    assert b_token is not None
