"""The GGUF header reader (model_loader/gguf/header.py) against gguf-py's GGUFReader: the same metadata
values of every kind and the same tensor layout, on files gguf.GGUFWriter writes here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from asyncllm.errors import UnsupportedModelError
from asyncllm.model_loader.gguf.header import read_gguf_header

V = gguf.GGUFValueType


def _write(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_uint32("t.u32", 7)
    writer.add_int32("t.i32", -5)
    writer.add_uint64("t.u64", 2**40 + 3)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 65535)
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strs", ["a", "", "Ġthe", "😀", "<|im_end|>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal(5).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("c.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _theirs(field: Any) -> Any:
    is_str = field.types[-1] == V.STRING
    values = [bytes(field.parts[i]).decode() if is_str else field.parts[i][0].item() for i in field.data]
    return values if field.types[0] == V.ARRAY else values[0]


def test_header_equals_gguf_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    ours, reader = read_gguf_header(path), gguf.GGUFReader(path)
    theirs = {k: _theirs(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == theirs
    assert ours.fields["t.strs"][3] == "😀" and ours.fields["t.u64"] == 2**40 + 3 and ours.fields["t.bool"] is True
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, t in zip(ours.tensors, reader.tensors):
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert (mine.ggml_type, mine.offset, mine.nbytes) == (int(t.tensor_type), t.data_offset, int(t.n_bytes))
    assert ours.file_size == path.stat().st_size


def test_big_endian_file_is_refused_clearly(tmp_path: Path) -> None:
    path = _write(tmp_path / "be.gguf", gguf.GGUFEndian.BIG)
    with pytest.raises(UnsupportedModelError, match=r"be\.gguf.*big-endian"):
        read_gguf_header(path)


@pytest.mark.parametrize("blob", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16])
def test_short_or_corrupt_headers_name_the_file(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(UnsupportedModelError, match=r"bad\.gguf"):
        read_gguf_header(path)
