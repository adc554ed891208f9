"""The CPU decode step's C ops (kernels/cpu_decode_ops.c) against their torch specification
(cpu_decode_ops_ref.py): fresh random inputs, odd sizes, float32 and bfloat16 inputs, outputs in float32 and in
one or two bfloat16 planes, several rows, a paged cache with shuffled blocks. Outputs start NaN-filled, so an
element left unwritten fails. Bad inputs raise naming what is wrong; a missing compiler gives None, not an error."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncllm.kernels import cpu_decode_native as native
from asyncllm.kernels.cpu_decode_ops_ref import (
    add_rms_norm_ref,
    as_planes,
    decode_attention_ref,
    q8_head_ref,
    quantize_rows_q8_ref,
    rope_kv_write_ref,
    silu_mul_ref,
)

F32_TOL = dict(rtol=1e-5, atol=1e-5)  # float32 sums in another order
BF16_TOL = dict(rtol=2**-7, atol=1e-5)  # one bfloat16 rounding step where a float32 sum landed near a tie


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> native.CpuDecodeOps:
    built = native.load(tmp_path_factory.mktemp("cpu_ops"))
    if built is None:
        pytest.skip("no C compiler builds the CPU decode ops here")
    return built


def _out(rows: int, n: int, planes: int) -> torch.Tensor:
    dtype = torch.float32 if planes == 0 else torch.bfloat16
    return torch.full((rows, max(planes, 1) * n), float("nan"), dtype=dtype)


def _close(got: torch.Tensor, want: torch.Tensor, planes: int) -> None:
    torch.testing.assert_close(got.float(), as_planes(want, planes).float(), **(F32_TOL if planes == 0 else BF16_TOL))


@pytest.mark.parametrize("rows,k", [(1, 576), (3, 67), (5, 1024)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planes", [0, 1, 2])
def test_add_rms_norm(ops: native.CpuDecodeOps, rows: int, k: int, x_dtype: torch.dtype, planes: int) -> None:
    x, residual, weight = torch.randn(rows, k).to(x_dtype), torch.randn(rows, k), torch.rand(k) + 0.5
    for add in (False, True):
        want_res, want = add_rms_norm_ref(x, residual, weight, 1e-6, add)
        res, out = residual.clone(), _out(rows, k, planes)
        ops.add_rms_norm(x, res, weight, 1e-6, out, add=add)
        torch.testing.assert_close(res, want_res, rtol=0, atol=0)  # one float32 add, as torch's
        _close(out, want, planes)


@pytest.mark.parametrize("rows,hq,hkv,d", [(1, 9, 3, 64), (4, 4, 4, 32), (3, 8, 2, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_write(
    ops: native.CpuDecodeOps, rows: int, hq: int, hkv: int, d: int, with_bias: bool, qkv_dtype: torch.dtype
) -> None:
    qkv = torch.randn(rows, (hq + 2 * hkv) * d).to(qkv_dtype)
    bias = torch.randn((hq + 2 * hkv) * d) if with_bias else None
    angles = torch.rand(rows, d // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(40)[:rows]
    k_rows, v_rows = torch.randn(40, hkv, d), torch.randn(40, hkv, d)
    k_want, v_want = k_rows.clone(), v_rows.clone()
    q_want = rope_kv_write_ref(qkv, bias, cos, sin, slots, hq, k_want, v_want)
    q = torch.full((rows, hq, d), float("nan"))
    ops.rope_kv_write(qkv, bias, cos, sin, slots, q, k_rows, v_rows)
    torch.testing.assert_close(q, q_want, **F32_TOL)  # a fused multiply-add may round once where torch rounds twice
    torch.testing.assert_close(k_rows, k_want, **F32_TOL)
    torch.testing.assert_close(v_rows, v_want, rtol=0, atol=0)  # untouched slots too


@pytest.mark.parametrize("rows,hq,hkv,d,seq_len,block_size", [(1, 9, 3, 64, 1, 16), (1, 9, 3, 64, 301, 16),
                                                              (3, 4, 1, 32, 17, 4), (2, 8, 8, 128, 64, 8)])  # fmt: skip
@pytest.mark.parametrize("planes", [0, 1, 2])
def test_decode_attention(
    ops: native.CpuDecodeOps, rows: int, hq: int, hkv: int, d: int, seq_len: int, block_size: int, planes: int
) -> None:
    per_row = -(-seq_len // block_size)
    num_blocks = rows * per_row + 3
    k_cache, v_cache = torch.randn(num_blocks, block_size, hkv, d), torch.randn(num_blocks, block_size, hkv, d)
    tables = torch.randperm(num_blocks)[: rows * per_row].view(rows, per_row).to(torch.int32)
    tables = torch.cat((tables, torch.zeros(rows, 2, dtype=torch.int32)), dim=1)  # unused entries past the keys
    q = torch.randn(rows, hq, d)
    out = _out(rows, hq * d, planes)
    ops.decode_attention(q, k_cache, v_cache, tables, seq_len, d**-0.5, out)
    _close(out, decode_attention_ref(q, k_cache, v_cache, tables, seq_len, d**-0.5), planes)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 100), (7, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planes", [0, 1, 2])
def test_silu_mul(ops: native.CpuDecodeOps, rows: int, inter: int, dtype: torch.dtype, planes: int) -> None:
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    gate_up[0, 0], gate_up[-1, inter - 1] = -120.0, 95.0  # exp's tails: silu -0 and x itself
    out = _out(rows, inter, planes)
    ops.silu_mul(gate_up, out)
    _close(out, silu_mul_ref(gate_up), planes)


@pytest.mark.parametrize("rows,vocab,k", [(1, 640, 576), (3, 100, 64), (2, 7, 32)])
def test_q8_head(ops: native.CpuDecodeOps, rows: int, vocab: int, k: int) -> None:
    codes = torch.randint(-127, 128, (vocab, k), dtype=torch.int8)
    scales, x = torch.rand(vocab, k // 32) * 0.02, torch.randn(rows, k) * 3
    x[0, :32] = 0.0  # a group of zeros: scale 0, codes 0
    xq, sx = ops.quantize_rows(x)
    want_q, want_s = quantize_rows_q8_ref(x)
    assert torch.equal(xq, want_q) and torch.equal(sx, want_s)  # the same roundings, bit for bit
    torch.testing.assert_close(ops.q8_head(codes, scales, x), q8_head_ref(codes, scales, x), rtol=1e-5, atol=1e-4)
    # x unquantized: each value within half its group's step (sx / 2) of its 8-bit code, so each logit within
    # sum |w| * sx / 2 of the exact one. (A bound of 2 % of the largest logit was not one: a random draw broke
    # it at 7 logits of one group.)
    weights = codes.float() * scales.repeat_interleave(32, dim=1)
    exact = x @ weights.T
    bound = (want_s.repeat_interleave(32, dim=1) / 2) @ weights.abs().T
    assert ((ops.q8_head(codes, scales, x) - exact).abs() <= bound * (1 + 1e-4) + 1e-4).all()
    with pytest.raises(ValueError, match="codes must be int8"):
        ops.q8_head(codes.int(), scales, x)


def test_nan_propagates(ops: native.CpuDecodeOps) -> None:
    gate_up = torch.randn(1, 8)
    gate_up[0, 1] = float("nan")
    out = _out(1, 4, 1)
    ops.silu_mul(gate_up, out)
    assert out[0, 1].isnan() and not out[0, [0, 2, 3]].isnan().any()


def test_bad_inputs_name_what_is_wrong(ops: native.CpuDecodeOps) -> None:
    with pytest.raises(ValueError, match="out must be float32"):
        ops.silu_mul(torch.randn(2, 8), torch.empty(2, 5))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ops.silu_mul(torch.randn(2, 8).half(), torch.empty(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.randn(8, 2).t(), torch.empty(2, 4))
    k = torch.randn(4, 4, 1, 8)
    with pytest.raises(IndexError, match="block outside"):
        table = torch.tensor([[7]], dtype=torch.int32)
        ops.decode_attention(torch.randn(1, 2, 8), k, k, table, 3, 1.0, torch.empty(1, 16))
    with pytest.raises(IndexError, match="slot outside"):
        rows = torch.randn(4, 1, 8)
        ops.rope_kv_write(torch.randn(1, 32), None, torch.randn(1, 4), torch.randn(1, 4), torch.tensor([4]),
                          torch.empty(1, 2, 8), rows, rows.clone())  # fmt: skip


def test_no_compiler_gives_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        assert native.load(tmp_path / "cache") is None
    assert "keeps torch's small ops" in caplog.text


def test_a_build_is_kept_and_reused(ops: native.CpuDecodeOps, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert native.load(cache) is not None
    built = sorted(cache.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no temporary file left beside it
    stamp = built[0].stat().st_mtime_ns
    assert native.load(cache) is not None
    assert sorted(cache.iterdir()) == built and built[0].stat().st_mtime_ns == stamp  # loaded, not built again


def test_the_micro_benchmark_runs(ops: native.CpuDecodeOps) -> None:
    bench = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "bench_cpu_decode_ops.py"
    cmd = [sys.executable, str(bench), "--keys", "20", "--repeats", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["op"] for r in rows] == ["add_rms_norm", "rope_kv_write", "decode_attention", "silu_mul"]
