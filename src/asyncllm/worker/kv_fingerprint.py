"""`kv_fingerprint`: what a KV block on disk depends on besides its tokens, as 16 bytes (xxh3-128): the disk
tier's directory is named by it and every file carries it, so an engine reads only blocks an engine of the same
model, weights and settings wrote, whose KV it would compute itself.

In it: the format's version and the source of the packages whose code computes KV (a change there may change its
numerics, so a cache from before it is not read); the architecture as resolved (layers,
heads, head size, rope, windows, ...), the weights' dtype and quantization, the KV cache's dtype, block size and
layout; the device type and attention backend (the same maths rounds differently elsewhere); the tensor-parallel
rank and size (a rank's shard); and the weights: each checkpoint file's name, size and sampled contents
(`_SAMPLES` spans of `_SPAN` bytes, evenly spread: two fine-tunes of one shape differ there), or, with
`load_format="dummy"`, the seed that draws them. Never the path: a copied checkpoint is the same model.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import xxhash

_FORMAT = 1
_PACKAGE = Path(__file__).resolve().parents[1]
_NUMERICS = ("models", "layers", "attention", "kernels", "quantization", "model_loader")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_FILES = ("config.json", "quantize_config.json", "quant_config.json")
_SAMPLES = 8
_SPAN = 64 << 10


def kv_fingerprint(checkpoint: Path, facts: dict[str, object]) -> bytes:
    """16 bytes naming the KV an engine computes: `facts` (plain values: architecture, dtypes, layout, rank,
    load format, ...) and the weights found at `checkpoint` (a directory, or one file)."""
    h = xxhash.xxh3_128()
    h.update(repr((_FORMAT, sorted((k, repr(v)) for k, v in facts.items()))).encode())
    h.update(_numerics_source())
    if facts.get("load_format") != "dummy":  # random weights from the seed (in `facts`): the files hold none
        for path in _weight_files(checkpoint):
            h.update(path.name.encode() + b"\0")
            _hash_file(h, path, whole=path.name in _CONFIG_FILES)
    return h.digest()


@cache
def _numerics_source() -> bytes:
    """A digest of every source file of the packages that compute KV."""
    h = xxhash.xxh3_128()
    for package in _NUMERICS:
        for path in sorted((_PACKAGE / package).rglob("*.py")):
            h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.digest()


def _weight_files(checkpoint: Path) -> list[Path]:
    if checkpoint.is_file():
        return [checkpoint]
    names = sorted(os.listdir(checkpoint)) if checkpoint.is_dir() else []
    return [checkpoint / n for n in names if n.endswith(_WEIGHT_SUFFIXES) or n in _CONFIG_FILES]


def _hash_file(h: xxhash.xxh3_128, path: Path, whole: bool) -> None:
    size = path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if whole or size <= _SAMPLES * _SPAN:
            h.update(f.read())
            return
        for i in range(_SAMPLES):
            f.seek((size - _SPAN) * i // (_SAMPLES - 1))
            h.update(f.read(_SPAN))
