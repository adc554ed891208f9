"""Structured output on the GPU: the Triton draw applies the bitmask (greedy and filtered rows too), steps
really overlap (the mask waits for the previous step's tokens on the device), CUDA graphs replay the forward
pass; every output satisfies its constraint and overlapped scheduling gives serial scheduling's tokens."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from asyncllm import LLM
from tests.structured.conftest import CONSTRAINTS, DRAWS, check, constrained

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.usefixtures("exact_fp32")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_constrained_outputs_on_the_gpu_overlapped_equal_serial(tiny_model: Path, dtype: str) -> None:
    common = dict(device="cuda", dtype=dtype, block_size=4, num_kv_blocks=256, max_num_seqs=16)
    cases = list(itertools.product(CONSTRAINTS, DRAWS, range(2)))
    params = [constrained(*case) for case in cases]
    prompts = [[5 + i % 7, 6, 7] for i in range(len(cases))]
    overlapped = LLM(str(tiny_model), **common)
    serial = LLM(str(tiny_model), async_scheduling=False, **common)
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
