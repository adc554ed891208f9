"""Cascade decode in the Triton backend: decode steps whose sequences share prefix blocks, prepared by the
worker's `InputBuffers` (which hands the backend the host block table), planned as a CUDA graph's decode bucket
replays them, give the torch reference's outputs; steps sharing nothing plan the plain variant.

Without CUDA the kernels run in Triton's CPU interpreter (float32).
"""

from __future__ import annotations

import random

import pytest
import torch

from asyncllm.attention.cascade import CascadeDecode
from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.step import ScheduledSeq, SchedulerOutput
from asyncllm.worker.buckets import Buckets
from asyncllm.worker.input_batch import InputBuffers
from tests.fixtures.triton_kernels import DEVICE, TOLERANCE, import_paged_attention

BLOCK, KV_HEADS, GROUP, DIM, MAX_SEQS = 4, 2, 2, 32, 16


@pytest.fixture(scope="module")
def kernels():
    return import_paged_attention()


def _backend(cascade: CascadeDecode | None):
    from asyncllm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(DEVICE, torch.float32, KV_HEADS, cascade=cascade)


def _decode_step(groups: list[tuple[int, list[int]]], singles: list[int], seed: int) -> SchedulerOutput:
    """One decode token per sequence; a group's members share its prefix's blocks (as prefix-cache hits do)."""
    rng = random.Random(seed)
    free = list(range(1, 400))
    rng.shuffle(free)
    seqs = []
    for prefix_blocks, suffixes in groups:
        shared = [free.pop() for _ in range(prefix_blocks)]
        for keys in suffixes:
            n = prefix_blocks * BLOCK + keys
            seqs.append((shared + [free.pop() for _ in range(-(-keys // BLOCK))], n))
    seqs += [([free.pop() for _ in range(-(-n // BLOCK))], n) for n in singles]
    rng.shuffle(seqs)
    return SchedulerOutput(seqs=[ScheduledSeq(f"r{i}", [1], n - 1, blocks, True) for i, (blocks, n) in enumerate(seqs)])


def _run(step: SchedulerOutput, cascade: CascadeDecode | None, window: int | None = None):
    """(triton output, torch output, the plan's graph variant) of one decode step padded to its bucket."""
    backend = _backend(cascade)
    buckets = Buckets.for_engine(backend, MAX_SEQS, 64, 0, 512)
    buffers = InputBuffers(64, MAX_SEQS, 512 // BLOCK, BLOCK, DEVICE, buckets.work_room())
    shape = buckets.shape(step, len(step.seqs))
    x = buffers.prepare(step, shape.pad_to, flush=False)
    buffers.stage_plan(x.meta, backend.plan(x.meta, shape.bounds), static=True)
    buffers.flush()
    gen = torch.Generator().manual_seed(len(step.seqs))
    cache_shape = (400, BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen).to(DEVICE) for _ in "kv")
    q = torch.randn(x.num_tokens, KV_HEADS * GROUP, DIM, generator=gen).to(DEVICE)
    out = backend.attend(q, k_cache, v_cache, x.meta, DIM**-0.5, window)
    assert x.meta.plan is not None
    variant = x.meta.plan.graph_variant
    x.meta.plan = None
    expected = TorchAttentionBackend().attend(q, k_cache, v_cache, x.meta, DIM**-0.5, window)
    rows = len(step.seqs)  # padding rows are nobody's
    return out[:rows], expected[:rows], variant


STEPS = [
    ([(5, [1, 3, 4, 9]), (3, [2, 2])], [7, 30]),  # two groups, two singles: bucket of 8
    ([(6, [1] * 12)], [2, 50, 9]),  # a group of 12: balanced units of at most 6 members (group 2: 32, here)
]


@pytest.mark.parametrize("groups, singles", STEPS)
@pytest.mark.slow
def test_cascade_plan_gives_the_reference_outputs(kernels, groups, singles) -> None:
    out, expected, variant = _run(_decode_step(groups, singles, seed=1), CascadeDecode(GROUP, min_prefix_tokens=8))
    assert variant == 1  # the cascade ran
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_sliding_layer_reads_its_window_under_a_cascade_plan(kernels) -> None:
    step = _decode_step([(5, [1, 3, 9])], [7], seed=2)
    out, expected, variant = _run(step, CascadeDecode(GROUP, min_prefix_tokens=8), window=6)
    assert variant == 1
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_steps_sharing_too_little_or_cascade_off_plan_the_plain_variant(kernels) -> None:
    step = _decode_step([(1, [1, 3])], [7, 9], seed=3)  # one shared block: under the minimum of 2
    assert _run(step, CascadeDecode(GROUP, min_prefix_tokens=8))[2] == 0
    shared = _decode_step([(5, [1, 3])], [], seed=3)
    out, expected, variant = _run(shared, None)
    assert variant == 0
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_graph_variants_are_offered_for_decode_buckets_only() -> None:
    from asyncllm.attention.backend import PlanBounds

    on, off = _backend(CascadeDecode(GROUP)), _backend(None)
    assert on.graph_variants(PlanBounds(16, 16, 512, decode_only=True)) == (0, 1)
    assert on.graph_variants(PlanBounds(1, 1, 512, decode_only=True)) == (0,)  # one sequence shares with nobody
    assert on.graph_variants(PlanBounds(64, 16, 512)) == (0,)  # mixed steps: plain
    assert off.graph_variants(PlanBounds(16, 16, 512, decode_only=True)) == (0,)
