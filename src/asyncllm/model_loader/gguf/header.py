"""A GGUF file's header read in one pass: metadata as plain Python values, and where each tensor lies.

Owns the file layout (GGUF v2/v3, little-endian: magic, counts, key/value metadata, tensor infos, aligned
data). gguf-py's reader builds a numpy view per string of the vocabulary (seconds, and ~150 MB of objects
for a 50k vocabulary); here each string is one slice of the mapped file. Knows nothing of what the keys or
tensors mean, and reads no tensor data (`open_data` maps the file for whoever does).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncllm.errors import UnsupportedModelError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 counted in 32 bits and is long gone
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> (struct format, numpy dtype) of the fixed-size scalar types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # outermost first (torch's order; the file lists dims innermost first)
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # from the start of the file
    nbytes: int  # what the shape and type need (the file's room for it is checked by the caller)

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    fields: dict[str, Any]  # key -> str, int, float, bool, or a list of them
    tensors: tuple[GGUFTensorInfo, ...]
    file_size: int

    def get(self, key: str) -> Any:
        return self.fields.get(key)


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of `path`; a file that is not GGUF, is truncated or corrupt raises UnsupportedModelError."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _Parser(mm, path).header()
    except UnsupportedModelError:
        raise
    except (struct.error, ValueError, OverflowError, UnicodeDecodeError, IndexError) as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc


def open_data(path: Path) -> mmap.mmap:
    """The file mapped copy-on-write: writable buffers (torch.frombuffer wants them) that never reach disk.
    Close it once no tensor views it."""
    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


class _Parser:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def header(self) -> GGUFHeader:
        if self.buf[:4] != _MAGIC:
            raise ValueError("GGUF magic missing")
        self.pos = 4
        version = self._scalar(4)
        if version not in _VERSIONS:
            detail = "big-endian files are not supported" if version & 0xFFFF == 0 else f"version {version}"
            raise UnsupportedModelError(f"{self.path}: unsupported GGUF file ({detail}; versions 2 and 3 are read)")
        num_tensors, num_fields = self._scalar(10), self._scalar(10)
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            if key in fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment!r} is not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        names = [name for name, *_ in infos]
        if len(set(names)) != len(names):
            raise ValueError("a tensor name appears twice")
        tensors = tuple(
            GGUFTensorInfo(name, shape, ggml_type, data_start + offset, _nbytes(name, shape, ggml_type))
            for name, shape, ggml_type, offset in infos
        )
        return GGUFHeader(self.path, fields, tensors, len(self.buf))

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = [self._scalar(10) for _ in range(self._scalar(4))]
        ggml_type, offset = self._scalar(4), self._scalar(10)
        return name, tuple(reversed(dims)), ggml_type, offset

    def _scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind][0]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        if start + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos = start + n
        return self.buf[start : self.pos].decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar(4), self._scalar(10)
            if item_kind in _SCALARS:  # numbers: one numpy read of the whole array
                dtype = np.dtype(_SCALARS[item_kind][1])
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return values.tolist()
            read: Callable[[], Any] = self._string if item_kind == _STRING else lambda: self._value(item_kind)
            return [read() for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self._scalar(kind)


def _nbytes(name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise UnsupportedModelError(f"GGUF tensor {name!r} has an unknown type id {ggml_type}") from None
    inner = shape[-1] if shape else 1
    if inner % block:
        raise ValueError(f"tensor {name!r}: rows of {inner} are not whole blocks of {block}")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * (inner // block) * type_size
