"""The torch dequantizers (model_loader/gguf/dequant.py) against gguf.quants, their specification: the same
bits for every block type done in torch, on random bytes (scales of every magnitude, NaN and inf included),
and the numpy fallback for the rest."""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
import torch

from asyncllm.model_loader.gguf.dequant import TORCH_TYPES, dequantize, dequantize_numpy

Q = gguf.GGMLQuantizationType


def _spec(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    rows = raw.reshape(-1, raw.size // int(np.prod(shape[:-1], dtype=np.int64)))
    with np.errstate(all="ignore"):  # random scales include NaN and inf
        array = np.array(gguf.quants.dequantize(rows, Q[type_name]), dtype=np.float32)
    return torch.from_numpy(array).reshape(shape)


@pytest.mark.parametrize("type_name", sorted(TORCH_TYPES))
@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 64), (32,)])
def test_torch_dequantize_equals_gguf_quants(type_name: str, shape: tuple[int, ...]) -> None:
    block, type_size = gguf.GGML_QUANT_SIZES[Q[type_name]]
    nbytes = int(np.prod(shape)) // block * type_size
    raw = np.random.default_rng(zlib.crc32(f"{type_name}{shape}".encode())).integers(0, 256, nbytes, dtype=np.uint8)
    got = dequantize(torch.from_numpy(raw.copy()), type_name, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    torch.testing.assert_close(got, _spec(raw, type_name, shape), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q5_0"])
def test_quantized_real_values_round_trip(type_name: str) -> None:
    """Values gguf quantizes (finite scales) come back as gguf dequantizes them, close to the originals."""
    values = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, Q[type_name]).reshape(-1)
    got = dequantize(torch.from_numpy(raw.copy()), type_name, (16, 128))
    torch.testing.assert_close(got, _spec(raw, type_name, (16, 128)), rtol=0, atol=0)
    assert (got - torch.from_numpy(values)).abs().max() < 0.5


def test_other_types_go_through_gguf_quants() -> None:
    """A K-quant (not done in torch) dequantizes through the fallback, to a fresh float32 tensor."""
    assert "Q6_K" not in TORCH_TYPES
    block, type_size = gguf.GGML_QUANT_SIZES[Q.Q6_K]
    raw = np.random.default_rng(1).integers(0, 256, 2 * type_size, dtype=np.uint8)
    raw[208:210] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)  # a finite super-block scale
    for path in (dequantize, dequantize_numpy):
        got = path(torch.from_numpy(raw.copy()), "Q6_K", (2, block))
        torch.testing.assert_close(got, _spec(raw, "Q6_K", (2, block)), rtol=0, atol=0, equal_nan=True)


def test_result_never_aliases_the_bytes() -> None:
    """F32 tensors would otherwise be views of the mapped file, which is closed after loading."""
    raw = torch.from_numpy(np.arange(4, dtype=np.float32).view(np.uint8).copy())
    out = dequantize(raw, "F32", (4,))
    raw.zero_()
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
