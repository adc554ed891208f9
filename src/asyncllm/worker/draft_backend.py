"""`draft_attention_backend`: the attention backend of a draft model or an EAGLE-3 head (draft_setup.py,
eagle3_setup.py), its own since its heads may differ from the target's. Knows nothing of the draft's weights.
"""

from __future__ import annotations

from asyncllm.attention.backend import AttentionBackend
from asyncllm.attention.registry import make_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.envs import CascadeAttention
from asyncllm.models.config import ModelArchConfig
from asyncllm.worker.device import ResolvedModel


def draft_attention_backend(config: EngineConfig, arch: ModelArchConfig, target: ResolvedModel) -> AttentionBackend:
    """The configured backend for the draft's heads (`arch`), on the target's device and in its dtype."""
    device, dtype = target.device, target.dtype
    # The KV in the activations' dtype (no FP8 scales to read for a draft), no cascade (a draft's attention
    # over a shared prefix is a small share of the step).
    return make_attention_backend(
        config.device_config.attention_backend,
        device,
        dtype,
        arch.num_kv_heads,
        dtype,
        CascadeAttention.OFF,
        arch.num_heads // arch.num_kv_heads,
        target.tuning.decode_fold_reduce,
    )
