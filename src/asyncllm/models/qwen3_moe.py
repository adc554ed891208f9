"""Qwen3-MoE: Qwen3's attention, with a sparse mixture-of-experts MLP in place of the dense one (in every
layer but those the config keeps dense: `mlp_only_layers`, `decoder_sparse_step`). No shared experts.

Only the maths choice per layer and the family's declaration: its experts (`mlp.experts.{e}.{gate,up,down}_proj`
in Hugging Face checkpoints, stacked `ffn_{gate,up,down}_exps` in GGUF files) split over ranks along each
expert's intermediate dimension, and the router (`mlp.gate`, GGUF `ffn_gate_inp`) whole on every rank.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from asyncllm.layers.moe import SparseMoE
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.family import ExpertsPlan, Split
from asyncllm.models.qwen3 import QWEN3_FAMILY, QWEN3_GGUF, Qwen3ForCausalLM

QWEN3_MOE_GGUF = QWEN3_GGUF.extended(
    ffn_gate_inp="mlp.gate",
    ffn_gate_exps="mlp.experts.gate_proj",
    ffn_up_exps="mlp.experts.up_proj",
    ffn_down_exps="mlp.experts.down_proj",
)
QWEN3_MOE_EXPERTS = ExpertsPlan(
    module="experts",
    column_parallel={"gate_proj": Split.EXPERT_INTERMEDIATE, "up_proj": Split.EXPERT_INTERMEDIATE},
    row_parallel={"down_proj": Split.EXPERT_INTERMEDIATE},
)
QWEN3_MOE_FAMILY = dataclasses.replace(
    QWEN3_FAMILY,
    weights=dataclasses.replace(QWEN3_FAMILY.weights, gguf=QWEN3_MOE_GGUF, experts=QWEN3_MOE_EXPERTS),
)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    family = QWEN3_MOE_FAMILY

    def layer_mlp(self, arch: ModelArchConfig, layer: int) -> nn.Module | None:
        moe = arch.moe
        if moe is None or layer in moe.dense_layers:
            return None  # Qwen3's dense MLP, at the config's intermediate_size
        return SparseMoE(arch.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize)
