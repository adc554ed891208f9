"""GGUF block types kept quantized: each type's own layout in the quantized layers' form (bits, inputs per scale,
zero points or mins, scale dtype), and the one layout that holds several types exactly (a packed layer whose
shards have different types, e.g. Q4_K_M's q/k in Q4_K beside v in Q6_K).

Plain data; knows no tensor (model_loader/gguf/repack.py writes the blocks into a layout) and no file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    bits: int  # 4 or 8: unsigned codes
    group_size: int  # inputs per scale
    zero_point: bool  # w = (q - z) * s; else w = q * s + m (mins)
    scale_dtype: str  # "float16" or "float32"


# The K-quants' scales d * sc (and mins dmin * m) are a float16 times a 6- or 8-bit integer: exact in float32
# only (float16 would round them, by up to 2**-12 relative). Every zero point below is a power of two.
GGUF_KEPT: dict[str, Layout] = {
    "Q8_0": Layout(8, 32, True, "float16"),  # d, 32 int8: x = d * q; codes q + 128, zero 128
    "Q4_0": Layout(4, 32, True, "float16"),  # d, nibbles: x = d * (q - 8)
    "Q4_1": Layout(4, 32, False, "float16"),  # d, m, nibbles: x = d * q + m
    "Q4_K": Layout(4, 32, False, "float32"),  # 8 x 32 per 256: x = d * sc * q - dmin * m
    "Q5_K": Layout(8, 32, False, "float32"),  # the same with 5-bit codes (in 8-bit fields)
    "Q6_K": Layout(8, 16, True, "float32"),  # 16 x 16 per 256: x = d * sc * (q - 32), sc int8
}


def joined(layouts: Iterable[Layout]) -> Layout:
    """The narrowest layout holding every one of `layouts` exactly: the widest codes, the smallest groups (each
    group size here divides the others: a scale repeats over the smaller groups), zero points only if all have
    them (else mins, -z * s: exact, z being a power of two, in float32), float32 scales if any needs them or
    zero points become mins."""
    given = list(layouts)
    assert given, "no layouts to join"
    zero_point = all(x.zero_point for x in given)
    wide = any(x.scale_dtype == "float32" for x in given) or (not zero_point and any(x.zero_point for x in given))
    group = min(x.group_size for x in given)
    assert all(x.group_size % group == 0 for x in given), given
    return Layout(max(x.bits for x in given), group, zero_point, "float32" if wide else "float16")
