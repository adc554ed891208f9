"""Structured output on the GPU: the Triton draw applies the bitmask (greedy and filtered rows too), steps
really overlap (the mask waits for the previous step's tokens on the device), CUDA graphs replay the forward
pass; every output satisfies its constraint and overlapped scheduling gives serial scheduling's tokens; the
grammar process (`ASYNCLLM_GRAMMAR_PROCESS=auto`, the default, on CUDA) changes no token, its draws waiting on
the device for its rows, and its death, those draws queued, stalls nothing: its requests fail, the others go on."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.fixtures.envs import serial_llm
from tests.structured.conftest import CONSTRAINTS, DRAWS, check, constrained
from tests.structured.test_grammar_process import grammar_processes, process_death_fails_its_requests_alone

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.usefixtures("exact_fp32")
@pytest.mark.parametrize("process", ["off", "auto"], ids=["held-draws", "device-waits"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_constrained_outputs_on_the_gpu_overlapped_equal_serial(
    tiny_model: Path, dtype: str, process: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Matchers in the step thread with jump-forward, each constrained draw held on the host until the next
    submit (ASYNCLLM_GRAMMAR_PROCESS=off), or queued at once behind a wait on the device for its rows (the default:
    with at most 16 requests live every jumping request stays in the step thread, wherever the process is)."""
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", process)
    common = dict(device="cuda", dtype=dtype, block_size=4, num_kv_blocks=256, max_num_seqs=16)
    cases = list(itertools.product(CONSTRAINTS, DRAWS, range(2)))
    params = [constrained(*case) for case in cases]
    prompts = [[5 + i % 7, 6, 7] for i in range(len(cases))]
    overlapped = LLM(str(tiny_model), **common)
    serial = serial_llm(str(tiny_model), **common)
    try:
        assert overlapped.runtime.cuda_graph_sizes, "the forward pass replays CUDA graphs"
        ours = overlapped.generate(prompts, params, use_tqdm=False)
        ref = serial.generate(prompts, params, use_tqdm=False)
        for (name, _, _), out in zip(cases, ours):
            assert out.finish_reason == "stop", (name, out.text)
            check(name, out.text)
        if dtype == "float32":
            assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
        assert overlapped.stats()["num_free_blocks"] == overlapped.stats()["num_total_blocks"]
    finally:
        overlapped.shutdown()
        serial.shutdown()


@pytest.mark.usefixtures("exact_fp32")
def test_grammar_process_starts_at_the_first_constrained_request_and_changes_no_token(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA `ASYNCLLM_GRAMMAR_PROCESS=auto` starts the grammar process in the background by the first constrained
    request (never by unconstrained ones); requests admitted meanwhile keep their matchers in the step
    thread, later ones go to the process, and neither changes a token (the twin: ASYNCLLM_GRAMMAR_PROCESS=off).
    Its rows are registered with CUDA as pinned memory, read by the draw's asynchronous copy."""
    # Matchers in the process never jump forward: the twin in the step thread draws every token too.
    monkeypatch.setenv("ASYNCLLM_JUMP_FORWARD", "0")
    common = dict(device="cuda", dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=16)
    cases = list(itertools.product(CONSTRAINTS, DRAWS, range(1)))
    params = [constrained(*case) for case in cases]
    prompts = [[5 + i % 7, 6, 7] for i in range(len(cases))]
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "auto")
    default = LLM(str(tiny_model), **common)
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "off")  # read where each engine resolves its model
    twin = LLM(str(tiny_model), **common)
    try:
        default.generate(prompts[:2], [SamplingParams(max_tokens=8)] * 2, use_tqdm=False)
        assert grammar_processes() == []
        want = [o.token_ids for o in twin.generate(prompts, params, use_tqdm=False)]
        assert [o.token_ids for o in default.generate(prompts, params, use_tqdm=False)] == want  # mostly in-thread
        deadline = time.monotonic() + 60
        while not grammar_processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(grammar_processes()) == 1
        time.sleep(10)  # past its start-up: the next requests' matchers live there
        ours = default.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in ours] == want
        for (name, _, _), out in zip(cases, ours):
            check(name, out.text)
    finally:
        default.shutdown()
        twin.shutdown()
    assert grammar_processes() == []


async def test_grammar_process_death_with_draws_waiting_on_the_device(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = dict(device="cuda", dtype="float32", block_size=4, num_kv_blocks=512, seed=7)
    await process_death_fails_its_requests_alone(tiny_model, monkeypatch, **args)
