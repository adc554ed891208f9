"""Which attention backend serves an `attention_backend` choice on a device.

"torch" is the pure-PyTorch reference; "triton" the paged Triton kernels (on CUDA, or on CPU in Triton's
interpreter when TRITON_INTERPRET=1 was set before triton was first imported). "auto" takes Triton on
CUDA when triton is installed (its kernels, backend and engine-level greedy parity passed on the H200:
bench/RESULTS.md), else the reference (on CPU it is fast enough and exact). ASYNCLLM_CASCADE_ATTENTION turns the
Triton backend's cascade decode on ("auto": on CUDA); the reference has none (it is what cascade must equal).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.attention.cascade import CascadeDecode
from asyncllm.config_values import AttentionBackendName
from asyncllm.envs import CascadeAttention
from asyncllm.errors import InvalidConfigError

# (device, activations' dtype, num_kv_heads, the KV cache's dtype, cascade decode's settings or None, whether
# the decode reduce folds into the split kernel, whether decode launches are programmatic dependents)
Factory = Callable[[torch.device, torch.dtype, int, torch.dtype, CascadeDecode | None, bool, bool], AttentionBackend]


def _torch(
    device: torch.device,
    dtype: torch.dtype,
    num_kv_heads: int,
    kv_cache_dtype: torch.dtype,
    cascade: CascadeDecode | None,
    fold_reduce: bool,
    pdl: bool,
) -> AttentionBackend:
    from asyncllm.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()  # the reference: every sequence reads all its keys (cascade's same maths)


def _triton(
    device: torch.device,
    dtype: torch.dtype,
    num_kv_heads: int,
    kv_cache_dtype: torch.dtype,
    cascade: CascadeDecode | None,
    fold_reduce: bool,
    pdl: bool,
) -> AttentionBackend:
    from asyncllm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(device, dtype, num_kv_heads, kv_cache_dtype, cascade, fold_reduce, pdl)


BACKENDS: dict[AttentionBackendName, Factory] = {
    AttentionBackendName.TORCH: _torch,
    AttentionBackendName.TRITON: _triton,
}


def resolve_backend_name(choice: AttentionBackendName, device: torch.device) -> AttentionBackendName:
    if choice is not AttentionBackendName.AUTO:
        return choice
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return AttentionBackendName.TRITON
    return AttentionBackendName.TORCH


def make_attention_backend(
    choice: AttentionBackendName,
    device: torch.device,
    dtype: torch.dtype,
    num_kv_heads: int,
    kv_cache_dtype: torch.dtype | None = None,  # None: the activations' dtype (kv_cache_dtype="auto")
    cascade: CascadeAttention = CascadeAttention.OFF,
    group: int = 1,  # query heads per KV head (cascade decode's unit rows)
    fold_reduce: bool = True,  # the Triton decode's reduce folded into its split kernel (ASYNCLLM_DECODE_FOLD_REDUCE)
    pdl: bool = False,  # the Triton decode kernel launched as a programmatic dependent (ASYNCLLM_DECODE_PDL)
) -> AttentionBackend:
    name = resolve_backend_name(choice, device)
    factory = BACKENDS.get(name)
    if factory is None:
        available = ", ".join(repr(n.value) for n in BACKENDS)
        raise InvalidConfigError(
            f"attention_backend={name.value!r} is not available in this version; use one of {available} or 'auto'"
        )
    if cascade is CascadeAttention.ON and name is not AttentionBackendName.TRITON:
        raise InvalidConfigError(
            f"ASYNCLLM_CASCADE_ATTENTION=on needs attention_backend='triton'; the {name.value!r} backend is the "
            "reference every sequence reads all its keys in: set ASYNCLLM_CASCADE_ATTENTION to auto or off with it"
        )
    on = cascade is CascadeAttention.ON or (cascade is CascadeAttention.AUTO and device.type == "cuda")
    settings = CascadeDecode(group) if on and name is AttentionBackendName.TRITON else None
    cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
    return factory(device, dtype, num_kv_heads, cache_dtype, settings, fold_reduce, pdl)
