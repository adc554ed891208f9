"""The specification of rotary position embeddings (rotate-half convention), in pure PyTorch: the layers'
torch path (`layers/rotary.py`) and the fused q/k kernel's reference (`qk_norm_rope_kv_ref.py`) call it.
Imports only torch.
"""

from __future__ import annotations

import torch


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D/2], computed in x's dtype.

    Equals transformers' `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)` exactly: per half that is
    x1*c - x2*s and x2*c + x1*s, and IEEE negation and subtraction make the two forms bit-identical.
    """
    cos = cos.to(x.dtype)[:, None, :]  # [T, 1, D/2]
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
