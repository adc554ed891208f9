"""The KV tiers on the GPU: the host pool pinned, its copies on side streams through a small staging buffer
(several chunks, runs of slots and scattered ones) byte for byte those of the CPU twin, bfloat16 and FP8 codes;
restores beside the compute stream until the next step joins them;
an engine with CUDA graphs and overlapped scheduling (float32) gives the tokens of one without tiers while it
restores evicted histories from host memory, and from disk after a restart; FP8 codes too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.test_kv_tiers_engine import HOST, converse
from tests.worker.test_kv_tiers_storage import random_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared (the disk reader's)"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_side_stream_copies_equal_the_cpu_twin(dtype: torch.dtype, shared: bool) -> None:
    from asyncllm.worker.kv_host import HostKVPool

    cpu_cache = random_cache(4, 40, (16, 2, 64), dtype)  # a tensor a layer: one copy a layer
    gpu_cache = random_cache(4, 40, (16, 2, 64), dtype, "cuda", stacked=True)  # one allocation, as the engine's
    gpu_cache = [(k.copy_(ck), v.copy_(cv)) for (k, v), (ck, cv) in zip(gpu_cache, cpu_cache, strict=True)]
    cpu = HostKVPool(cpu_cache, 24, torch.device("cpu"))
    block_bytes = cpu.block_bytes
    gpu = HostKVPool(gpu_cache, 24, torch.device("cuda"), staging_bytes=3 * block_bytes, shared=shared)  # chunks of 3
    assert gpu.host.is_pinned()
    assert (gpu.shared_fd is not None) == shared  # the shared memory pinned as well
    rng = random.Random(0)
    blocks = rng.sample(range(40), 20)
    slots = [*range(5, 13), *rng.sample(range(13, 24), 6), 0, 2, 1, 4, 3, 19]  # runs and scattered slots
    offloads = list(zip(blocks, slots[:20], strict=True))
    for pool in (cpu, gpu):
        pool.begin()
        pool.to_host(offloads)
    gpu.synchronize()
    written = torch.tensor(slots[:20])
    assert torch.equal(gpu.host[written], cpu.host[written])  # the other slots were never written
    restores = list(zip(rng.sample(slots[:20], 12), rng.sample(range(40), 12), strict=True))
    for pool in (cpu, gpu):
        pool.to_device(restores)
        pool.join()
    torch.cuda.synchronize()
    for (ck, cv), (gk, gv) in zip(cpu_cache, gpu_cache, strict=True):
        assert torch.equal(gk.cpu().view(torch.uint8), ck.view(torch.uint8))
        assert torch.equal(gv.cpu().view(torch.uint8), cv.view(torch.uint8))
    gpu.close()


def test_restores_run_beside_the_compute_stream_until_joined() -> None:
    """Restores go on a stream of their own: work queued on the compute stream after them does not wait for
    them (the forward pass of the step that issues them), work queued after `join_restores` does (the next
    step's), and the blocks are then byte for byte the CPU twin's."""
    from asyncllm.worker.kv_host import HostKVPool

    cpu_cache = random_cache(4, 40, (16, 2, 64), torch.bfloat16)
    gpu_cache = [(k.cuda(), v.cuda()) for k, v in cpu_cache]
    cpu, gpu = (HostKVPool(c, 8, torch.device(d)) for c, d in ((cpu_cache, "cpu"), (gpu_cache, "cuda")))
    for pool in (cpu, gpu):
        pool.to_host([(b, b) for b in range(8)])
    gpu.synchronize()
    restores = [(s, 20 + s) for s in range(8)]
    cpu.to_device(restores)
    assert gpu.restore_stream is not None
    # Once before the timed restore: a first pinned allocation of the block ids' size (torch's caching host
    # allocator) waits for the whole device, which is not what this test looks at.
    gpu.to_device(restores)
    gpu.join_restores()
    torch.cuda.synchronize()
    with torch.cuda.stream(gpu.restore_stream):
        torch.cuda._sleep(400_000_000)  # the restore stream is busy for a while (~0.2 s)
    gpu.to_device(restores)
    assert gpu.restoring
    beside = torch.cuda.Event()
    beside.record()  # the compute stream, after the restores were issued
    beside.synchronize()
    assert not gpu.restore_stream.query(), "the compute stream waited for the restores"
    gpu.join_restores()
    assert not gpu.restoring
    after = torch.cuda.Event()
    after.record()
    after.synchronize()
    assert gpu.restore_stream.query(), "the compute stream ran past the restores after joining them"
    for (ck, cv), (gk, gv) in zip(cpu_cache, gpu_cache, strict=True):
        assert torch.equal(gk.cpu().view(torch.uint8), ck.view(torch.uint8))
        assert torch.equal(gv.cpu().view(torch.uint8), cv.view(torch.uint8))
    gpu.close()


@pytest.mark.usefixtures("exact_fp32")
def test_an_engine_restores_from_host_and_disk_with_graphs_and_overlap(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = tiny_checkpoints["qwen3"]
    cuda = dict(device="cuda", dtype="float32")  # recomputed and restored KV then agree to the last token
    want, _ = converse(path, **cuda)
    tokens, stats = converse(path, **cuda, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == want and stats["prefix_cache_host_hit_tokens"] > 100
    tokens, stats = converse(path, **cuda, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == want and stats["prefix_cache_disk_hit_tokens"] > 100
    tokens, stats = converse(path, **cuda, kv_cache_dtype="fp8", kv_offloading_size=HOST)
    want, _ = converse(path, **cuda, kv_cache_dtype="fp8")
    assert tokens == want and stats["prefix_cache_host_hit_tokens"] > 100
