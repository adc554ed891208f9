"""The paged Triton attention kernels over an FP8 cache (`kv_cache_dtype="fp8"`) against `paged_attention_ref`
reading the same e4m3 codes: decode (one split and several), prefill, chunks whose keys start before their
queries, sliding windows, and a CUDA graph's fixed grids, with scales other than 1 (a kernel that ignored
either scale, or applied one twice, is off by that factor). Never-written slots hold e4m3 NaN. CPU runs use
float32 queries in Triton's interpreter; bfloat16 on GPU. Also every kernel variant compiled for Hopper."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_paged_attention
from tests.kernels.test_paged_attention import check, make_batch, run_decode, run_prefill
from tests.kernels.test_paged_attention_window import _poison_outside_windows

E4M3 = torch.float8_e4m3fn
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# Keys and values are N(0, 1): codes up to ~11 and ~3 (never saturated), scales that are no power of two.
K_SCALE, V_SCALE = 0.37, 1.55


@pytest.fixture(scope="module")
def pa():
    return import_paged_attention()


def scales(k: float = K_SCALE, v: float = V_SCALE) -> dict[str, torch.Tensor]:
    return {"k_scale": torch.tensor(k, device=DEVICE), "v_scale": torch.tensor(v, device=DEVICE)}


def fp8_batch(seqs, num_kv_heads: int, group: int, head_dim: int, block_size: int, dtype, seed: int, **kv):
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed, kv_dtype=E4M3, **kv)
    assert batch[1].dtype == E4M3
    return batch


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(2, 2, 64, 16), (1, 8, 24, 4)])
@pytest.mark.slow
def test_decode_matches_ref(pa, num_kv_heads: int, group: int, head_dim: int, block_size: int) -> None:
    kv = scales()
    batch = fp8_batch([(n - 1, 1) for n in (1, 2, 17, 100, 257)], num_kv_heads, group, head_dim, block_size,
                      torch.float32, seed=group, **kv)  # fmt: skip
    for num_splits in (1, 3):
        out = run_decode(pa, *batch, 0.125, num_splits, block_n=32, **kv)
        check(pa, out, *batch, 0.125, **kv)


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(2, 2, 64, 16), (1, 8, 24, 4)])
@pytest.mark.slow
def test_prefill_and_chunks_match_ref(pa, num_kv_heads: int, group: int, head_dim: int, block_size: int) -> None:
    kv = scales()
    seqs = [(0, 2), (0, 17), (13, 2), (16, 15), (45, 40), (3, 7)]  # contexts of 0, part of a tile, one, 2.8 tiles
    batch = fp8_batch(seqs, num_kv_heads, group, head_dim, block_size, torch.float32, seed=3 + group, **kv)
    check(pa, run_prefill(pa, *batch, 0.125, block_m=16, block_n=16, **kv), *batch, 0.125, **kv)


def test_scales_are_applied_on_read(pa) -> None:
    """The same codes read with other scales: keys scaled by 2 sharpen the scores (another output), values
    scaled by 2 double it exactly."""
    q, k_cache, v_cache, meta = batch = fp8_batch([(40, 1), (0, 9)], 2, 2, 64, 16, torch.float32, seed=11, **scales())
    decode = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    outs = {}
    for k, v in ((1.0, 1.0), (2.0, 1.0), (1.0, 2.0)):
        out = run_prefill(pa, *batch, 0.125, block_m=16, block_n=16, **scales(k, v))
        args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, decode, out, 0.125)
        pa.paged_decode_attention(*args, num_splits=1, **scales(k, v))
        check(pa, out, *batch, 0.125, **scales(k, v))
        outs[k, v] = out
    torch.testing.assert_close(outs[1.0, 2.0], 2 * outs[1.0, 1.0], atol=1e-5, rtol=1e-5)
    assert (outs[2.0, 1.0] - outs[1.0, 1.0]).abs().max() > 0.01


@pytest.mark.parametrize("window", [1, 5, 33])
@pytest.mark.slow
def test_sliding_window_matches_ref(pa, window: int) -> None:
    """Decode and chunked prefill of a sliding layer; every slot outside every window is e4m3 NaN."""
    kv = scales()
    for seqs, launch in (
        ([(n - 1, 1) for n in (2, 17, 100)], lambda b: run_decode(pa, *b, 0.125, 3, block_n=16, window=window, **kv)),
        ([(13, 2), (40, 30), (0, 17)], lambda b: run_prefill(pa, *b, 0.125, block_m=16, block_n=16, window=window,
                                                            **kv)),
    ):  # fmt: skip
        q, k_cache, v_cache, meta = batch = fp8_batch(seqs, 2, 2, 64, 4, torch.float32, seed=window, **kv)
        args = (q, k_cache, v_cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, 0.125)
        ref = pa.paged_attention_ref(*args, window=window, **kv)
        _poison_outside_windows(k_cache, v_cache, meta, window)
        out = launch(batch)
        assert not out.isnan().any(), "a row unwritten, or a slot outside the window read"
        torch.testing.assert_close(out, ref, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_graph_shaped_launches_match_ref(pa) -> None:
    """A decode grid padded with -1 entries and a prefill grid striding over more tiles than programs."""
    kv = scales()
    q, k_cache, v_cache, meta = batch = fp8_batch([(13, 2), (0, 40), (8, 1), (30, 1)], 2, 2, 64, 16, torch.float32,
                                                  seed=5, **kv)  # fmt: skip
    ref = pa.paged_attention_ref(
        q, k_cache, v_cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, 0.125, **kv
    )
    decoded = run_decode(pa, *batch, 0.125, 2, pad=3, block_n=32, **kv)
    prefilled = run_prefill(pa, *batch, 0.125, block_m=16, block_n=16, capacity=8, num_programs=2, **kv)
    rows = [int(meta.query_start_loc[i]) for i in (2, 3)]
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(decoded[rows], ref[rows], atol=tol, rtol=tol)
    prefill_rows = [r for r in range(q.shape[0]) if r not in rows]
    torch.testing.assert_close(prefilled[prefill_rows], ref[prefill_rows], atol=tol, rtol=tol)


def test_launchers_refuse_missing_or_bad_scales(pa) -> None:
    kv = scales()
    batch = fp8_batch([(3, 1)], 1, 1, 16, 4, torch.float32, seed=0, **kv)
    with pytest.raises(TypeError, match="an FP8 KV cache needs its k_scale"):
        run_decode(pa, *batch, 0.125, 1)
    with pytest.raises(TypeError, match="v_scale must be a float32 tensor of one element"):
        run_decode(pa, *batch, 0.125, 1, k_scale=kv["k_scale"], v_scale=kv["v_scale"].double())
    with pytest.raises(TypeError, match="k_scale must be a float32 tensor of one element"):
        run_prefill(pa, *batch, 0.125, block_m=16, k_scale=torch.ones(2, device=DEVICE), v_scale=kv["v_scale"])
    q, k_cache, v_cache, meta = batch
    with pytest.raises(TypeError, match="the caches that dtype or float8_e4m3fn"):
        run_decode(pa, q, k_cache, v_cache.float(), meta, 0.125, 1, **kv)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_kernels_match_ref(pa, dtype: torch.dtype, block_size: int) -> None:
    """16-bit queries over an e4m3 cache: decode, prefill, chunks and a window, at the shared tolerance."""
    kv = scales()
    for num_kv_heads, group, head_dim in ((2, 2, 128), (8, 2, 64), (1, 8, 128)):
        decode = fp8_batch([(n - 1, 1) for n in (1, 17, 257, 1000, 2048)], num_kv_heads, group, head_dim, block_size,
                           dtype, seed=group, **kv)  # fmt: skip
        for num_splits in (1, 4, 16):
            check(pa, run_decode(pa, *decode, head_dim**-0.5, num_splits, **kv), *decode, head_dim**-0.5, **kv)
        prefill = fp8_batch([(0, 300), (100, 129), (1000, 17), (0, 2)], num_kv_heads, group, head_dim, block_size,
                            dtype, seed=7, **kv)  # fmt: skip
        check(pa, run_prefill(pa, *prefill, head_dim**-0.5, block_m=128, **kv), *prefill, head_dim**-0.5, **kv)
        q, k_cache, v_cache, meta = prefill
        args = (q, k_cache, v_cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, 0.125)
        ref = pa.paged_attention_ref(*args, window=100, **kv)
        out = run_prefill(pa, *prefill, 0.125, block_m=128, window=100, **kv)
        torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.slow
def test_every_variant_compiles_for_hopper() -> None:
    """Each paged-attention and KV-write kernel variant the engine launches (bf16 / fp16 / fp32 queries over a
    cache of their dtype or e4m3, global and sliding) through Triton's compiler and ptxas for sm_90, as
    tests/kernels/hopper_compile_attention.py does on CPU."""
    pytest.importorskip("triton")
    script = Path(__file__).with_name("hopper_compile_attention.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.count("ok ") == 26, out.stdout
