"""The GEMV over plain float weights (`linear_gemv`, kernels/quant_matmul_gemv.py) against F.linear in float32,
its specification.

CPU (Triton's interpreter, float32): output counts that leave a partial row tile, K with a partial tile, K split
1-3 ways (the last program of a tile adds the partial sums), one to three token rows, strided rows, bias, every
tile the sweep may pick; then every linear shape of the supported models at the split the H200 runs it with
(bfloat16's tile, mirrored in float32), over its first output tile (the other tiles run the same code on other
rows). The split counters end at zero so a layer reuses them across calls and graph replays. GPU (bfloat16 and
float16): every model shape at one and two rows with the launcher's own config, and every candidate config on
the Qwen3-0.6B shapes. Tolerance: the shared table.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm.kernels import gemv_plan as plans
from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_kernel
from tests.kernels.test_quant_matmul import MODEL_SHAPES

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
H200_SMS = 132


@pytest.fixture(scope="module")
def gemv():
    return import_kernel("quant_matmul_gemv")


def check(gemv, m: int, n: int, k: int, dtype: torch.dtype, seed: int, *, split_k: int | None = None, x_pad: int = 0,
          bias: bool = False, config: plans.GemvConfig | None = None, calls: int = 2) -> None:  # fmt: skip
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(dtype)
    x = torch.randn(m, k + x_pad, generator=gen, device=DEVICE).to(dtype)[:, :k]  # strided rows when padded
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    locks = gemv.gemv_locks(n, m, DEVICE)
    for _ in range(calls if split_k != 1 else 1):  # a second call reuses the counters the first left
        got = gemv.linear_gemv(x, weight, b, split_k=split_k, locks=locks, config=config)
        assert int(locks.count_nonzero()) == 0, "the split counters must be zero again after a call"
    want = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("m", "k", "split_k", "bias"), [(1, 512, 2, True), (3, 392, 3, False), (2, 136, 1, True)])
def test_matches_f_linear(gemv, m: int, k: int, split_k: int, bias: bool) -> None:
    """70 outputs (a partial row tile); K of whole tiles and K with a partial last tile; strided rows."""
    check(gemv, m, 70, k, torch.float32, seed=m + k, split_k=split_k, x_pad=8 * (m - 1), bias=bias)


@pytest.mark.parametrize("tile", plans.CANDIDATE_TILES, ids=lambda t: "bn{}-w{}-rb{}".format(*t))
def test_every_candidate_tile(gemv, tile: tuple[int, int, int]) -> None:
    """Each tile the sweep may pick: its row tiles (a partial one), K tiles (a partial one) and the split."""
    block_n, num_warps, row_bytes = tile
    config = plans.GemvConfig(block_n=block_n, num_warps=num_warps, row_bytes=row_bytes)
    check(gemv, 1, block_n + 6, 2 * row_bytes // 4 + 24, torch.float32, seed=block_n + row_bytes, split_k=2,
          bias=True, config=config)  # fmt: skip


def _shapes() -> list[tuple[int, int]]:
    return sorted({shape for shapes in MODEL_SHAPES.values() for shape in shapes})


def _h200_launches() -> dict[tuple[int, int, int], tuple[int, int]]:
    """(K, split, tiles per split) of every model shape's bfloat16 launch on the H200 -> one such (N, K)."""
    launches: dict[tuple[int, int, int], tuple[int, int]] = {}
    for n, k in _shapes():
        plan = plans.gemv_plan(1, n, k, plans.FLOAT16, k, H200_SMS, config=plans.config_for(plans.FLOAT16, n, k))
        assert plan is not None and plan.split * plan.tiles_per_split >= -(-k // plan.group_words), (n, k)
        launches.setdefault((k, plan.split, plan.tiles_per_split), (n, k))
    return launches


@pytest.mark.parametrize("launch", sorted(_h200_launches()), ids=lambda v: "K{}-split{}x{}".format(*v))
def test_every_model_shape_at_the_h200_split(gemv, launch: tuple[int, int, int]) -> None:
    """Each distinct K split the H200 runs a bfloat16 layer of a supported model with (most shapes share one
    with another), on the same K tiles in float32 (twice the bytes a row), over the first tile of output rows."""
    n, k = _h200_launches()[launch]
    config = plans.config_for(plans.FLOAT16, n, k)
    mirrored = plans.GemvConfig(block_n=config.block_n, row_bytes=2 * config.row_bytes)
    mirror = plans.gemv_plan(1, n, k, plans.FLOAT32, k, H200_SMS, launch[1], mirrored)
    assert mirror is not None and (k, mirror.split, mirror.tiles_per_split) == launch
    check(gemv, 1, min(n, config.block_n), k, torch.float32, seed=n + k, split_k=launch[1], config=mirrored, calls=1)


def test_launcher_checks(gemv) -> None:
    w = torch.randn(48, 64, device=DEVICE)
    with pytest.raises(TypeError, match=r"weight has dtype torch\.float16 and x torch\.float32"):
        gemv.linear_gemv(torch.randn(1, 64, device=DEVICE), w.half())
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with contiguous rows"):
        gemv.linear_gemv(torch.randn(1, 48, device=DEVICE), w.t())
    with pytest.raises(ValueError, match=r"x must be \[M, K=64\]"):
        gemv.linear_gemv(torch.randn(1, 63, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[N=48\]"):
        gemv.linear_gemv(torch.randn(1, 64, device=DEVICE), w, torch.randn(47, device=DEVICE))
    assert gemv.linear_gemv(torch.randn(0, 64, device=DEVICE), w).shape == (0, 48)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_model_shapes(gemv, dtype: torch.dtype) -> None:
    for n, k in _shapes():
        for m in (1, 2):
            check(gemv, m, n, k, dtype, seed=n + k + m, bias=m == 2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_every_candidate_config(gemv) -> None:
    for config in plans.candidate_configs(plans.FLOAT16):
        for n, k in MODEL_SHAPES["qwen3-0.6b"]:
            check(gemv, 1, n, k, torch.bfloat16, seed=n + k, config=config)
