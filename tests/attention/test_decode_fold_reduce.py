"""The Triton backend's folded decode reduce (`TritonPlan.fold_reduce`, ASYNCLLM_DECODE_FOLD_REDUCE)
against its twin, the reduce launch, and the torch backend: decode steps over several KV splits, planned
eagerly and for a mixed graph's fixed shape (decode entries of -1, rows of no sequence), three steps in a row
on one backend (each launch must leave its tickets clean for the next), a sliding layer beside a global one.

Without CUDA the kernels run in Triton's CPU interpreter (float32), where a CPU "GPU" of one SM plans one
split: the tests set the plan's split count (a plan field) to make the steps split."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.backend import PlanBounds
from asyncllm.attention.torch_ref import TorchAttentionBackend
from tests.fixtures.paged import PagedBatcher
from tests.fixtures.triton_kernels import DEVICE, TOLERANCE, import_paged_attention

KV_HEADS, GROUP, HEAD_DIM = 2, 2, 32


@pytest.fixture(scope="module")
def kernels():
    return import_paged_attention()


def _backend(fold_reduce: bool):
    from asyncllm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(DEVICE, torch.float32, KV_HEADS, fold_reduce=fold_reduce)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-planned"])
@pytest.mark.slow
def test_fold_and_reduce_equal_torch_backend_over_steps(kernels, graph: bool) -> None:
    gen = torch.Generator().manual_seed(int(graph))
    batcher = PagedBatcher(num_blocks=64, block_size=16, seed=1)
    [(k_cache, v_cache)] = [
        (k.to(DEVICE), v.to(DEVICE)) for k, v in batcher.new_caches(1, KV_HEADS, HEAD_DIM, torch.float32)
    ]
    prompts = [(0, 90), (1, 7), (2, 150), (3, 33)]
    _, meta = batcher.step(prompts)
    k, v = (torch.randn(280, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE) for _ in "kv")
    TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, _on_device(meta))
    reference, folded, twin = TorchAttentionBackend(), _backend(True), _backend(False)
    for step, seqs in enumerate(([0, 1, 2, 3], [2, 0, 3], [1, 2, 0, 3])):  # lengths grow by one each step
        _, meta = batcher.step([(s, 1) for s in seqs])
        meta = _on_device(meta)
        q = torch.randn(len(seqs), KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(DEVICE)
        k, v = (torch.randn(len(seqs), KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE) for _ in "kv")
        reference.write_kv(k, v, k_cache, v_cache, meta)
        reference.plan_and_upload(meta)
        expected = {w: reference.attend(q, k_cache, v_cache, meta, 0.17, w) for w in (None, 40)}
        bounds = PlanBounds(8, 6, 512) if graph else None  # a mixed graph's: decode entries of -1 after
        for backend in (folded, twin):
            backend.plan_and_upload(meta, bounds)
            meta.plan.num_splits = 3  # 3 splits of the longest: the short ones keep 1 or 2 live
            assert meta.plan.fold_reduce is (backend is folded)
            for window in (None, 40):
                meta.plan.window_splits[40] = 2
                out = backend.attend(_padded(q, 8) if graph else q, k_cache, v_cache, meta, 0.17, window)
                torch.testing.assert_close(
                    out[: len(seqs)], expected[window], atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32],
                    msg=lambda m, step=step, window=window: f"step {step} window {window}: {m}",
                )  # fmt: skip


def test_plan_field_switches_one_backend(kernels) -> None:
    """A benchmark's A/B in one process: the same backend and plan, fold off then on, equal outputs."""
    gen = torch.Generator().manual_seed(3)
    batcher = PagedBatcher(num_blocks=32, block_size=16, seed=2)
    [(k_cache, v_cache)] = [
        (k.to(DEVICE), v.to(DEVICE)) for k, v in batcher.new_caches(1, KV_HEADS, HEAD_DIM, torch.float32)
    ]
    _, meta = batcher.step([(0, 120), (1, 60)])
    k, v = (torch.randn(180, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE) for _ in "kv")
    TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, _on_device(meta))
    _, meta = batcher.step([(0, 1), (1, 1)])
    meta = _on_device(meta)
    q, k, v = (torch.randn(2, n, HEAD_DIM, generator=gen).to(DEVICE) for n in (KV_HEADS * GROUP, KV_HEADS, KV_HEADS))
    TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, meta)
    backend = _backend(True)
    backend.plan_and_upload(meta)
    meta.plan.num_splits = 4
    outs = []
    for fold in (False, True, False):
        meta.plan.fold_reduce = fold
        outs.append(backend.attend(q, k_cache, v_cache, meta, 0.2))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(outs[2], outs[0], atol=0, rtol=0)


def _on_device(meta):
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return meta


def _padded(q: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([q, torch.zeros(rows - q.shape[0], *q.shape[1:], device=q.device)])
