"""What a model family declares about itself, in one frozen `FamilySpec` on its model class: the variation
points its shared layers take, and its weight plan (which checkpoint tensors pack into which of our modules,
how each is split over tensor-parallel ranks, and the GGUF names of its tensors).

The weight loader (`models/weights.py`), tensor parallelism (`models/tensor_parallel.py`) and the GGUF reader
(`model_loader/gguf/`) read the spec and know no family's names. Knows no model file, file format or process
group. Where the five numerics variation points live:
- norm and activation: `FamilySpec.norm` / `.activation`, the layer classes every norm / MLP site builds;
- embedding scale: `FamilySpec.embedding_scale` (Gemma multiplies embeddings by sqrt(hidden_size));
- attention scale and final-logit softcap: per checkpoint, `ModelArchConfig.query_pre_attn_scalar` and
  `.final_logit_softcapping`, read from the config and applied by the family's model when not None.
None everywhere means "not applied": the defaults are Llama's numbers, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from torch import nn

from asyncllm.layers.activation import SiluAndMul
from asyncllm.layers.norm import RMSNorm


class Split(Enum):
    """The architecture dimension a tensor-parallel tensor is cut along: a column-parallel layer's output
    rows (weight and bias), a row-parallel layer's input columns (weight only; its bias is added once after
    the all-reduce)."""

    QUERY_HEADS = "num_heads"  # this rank's query heads, head_dim rows each
    KV_HEADS = "num_kv_heads"  # this rank's KV heads, or the one its query heads share when ranks outnumber them
    INTERMEDIATE = "intermediate_size"  # this rank's slice of the MLP
    EXPERT_INTERMEDIATE = "moe_intermediate_size"  # this rank's slice of every expert's MLP


class EmbeddingScale(Enum):
    """A multiplier on the token embeddings, rounded to the weights' dtype as transformers does."""

    SQRT_HIDDEN = "sqrt_hidden"  # Gemma: sqrt(hidden_size)


@dataclass(frozen=True)
class GGUFNames:
    """How llama.cpp names a family's tensors: `{gguf}.weight` for a whole-model tensor, and
    `blk.{i}.{gguf}.weight` for a layer's, becoming `{layers}.{i}.{hf}.weight` in the checkpoint's names."""

    globals: Mapping[str, str]  # GGUF name -> checkpoint module path, e.g. token_embd -> model.embed_tokens
    blocks: Mapping[str, str]  # GGUF name -> module path inside a layer, e.g. attn_q -> self_attn.q_proj
    layers: str  # the checkpoint's path of the layer list, e.g. model.layers

    def __post_init__(self) -> None:
        for name in ("globals", "blocks"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def extended(self, **blocks: str) -> GGUFNames:
        """These names plus more per-layer ones (a family adding tensors to its parent's)."""
        return GGUFNames(self.globals, {**self.blocks, **blocks}, self.layers)


@dataclass(frozen=True)
class ExpertsPlan:
    """Where a MoE layer's experts are in a checkpoint, and how their projections split over ranks.

    A Hugging Face checkpoint holds one tensor per expert, `{module}.{e}.{proj}.weight` (mlp.experts.3.gate_proj);
    a GGUF file one tensor per projection with every expert stacked, `{module}.{proj}.weight` [E, ...]. Both
    load into our stacked `{module}.{proj}.weight` [E, out, in], packed as the plan's `packed` says (gate_proj
    and up_proj into gate_up_proj). `column_parallel` / `row_parallel` as in `WeightPlan`, for one expert's
    [out, in] (a stacked tensor is cut one dimension further in)."""

    module: str  # the last component of a layer's expert list, e.g. "experts"
    column_parallel: Mapping[str, Split]
    row_parallel: Mapping[str, Split]

    def __post_init__(self) -> None:
        for name in ("column_parallel", "row_parallel"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def projection(self, module_path: str) -> tuple[str, bool] | None:
        """(the projection's name, whether the tensor is stacked) for a checkpoint module path inside an
        expert list: `....experts.3.gate_proj` -> ("gate_proj", False), `....experts.gate_proj` -> ("gate_proj",
        True); None for any other path."""
        parts = module_path.split(".")
        if len(parts) >= 3 and parts[-3] == self.module and parts[-2].isdigit():
            return parts[-1], False
        if len(parts) >= 2 and parts[-2] == self.module:
            return parts[-1], True
        return None


@dataclass(frozen=True)
class WeightPlan:
    """A family's checkpoint names and how they become our parameters, whole or one rank's shard.

    Names are checkpoint module names (the part before `.weight` / `.bias`): `packed`, `column_parallel` and
    `row_parallel` match the last component (the same in every layer), `embedding` and `lm_head` the whole
    path. Our module paths equal the checkpoint's except where `packed` maps several into one.
    """

    # checkpoint module -> (our packed module, its shard), e.g. q_proj -> (qkv_proj, q): vLLM's
    # packed_modules_mapping, turned around so each checkpoint tensor finds its rows
    packed: Mapping[str, tuple[str, str]]
    column_parallel: Mapping[str, Split]  # each rank holds some output rows; nothing to combine
    row_parallel: Mapping[str, Split]  # each rank holds some input columns; partial sums all-reduced
    embedding: str  # the token embedding's path; vocab-parallel (rows of the vocabulary)
    lm_head: str  # the output head's path, absent from the model when tied; vocab-parallel, all-gathered
    gguf: GGUFNames | None = None  # None: the family has no GGUF form
    ignored_suffixes: tuple[str, ...] = ()  # checkpoint extras that carry nothing (old rotary buffers)
    experts: ExpertsPlan | None = None  # None: no MoE layers

    def __post_init__(self) -> None:
        # Row-parallel layers are swapped for their communicating form by name, so they must keep theirs.
        row_parallel = set(self.row_parallel) | set(self.experts.row_parallel if self.experts else ())
        if packed := sorted(row_parallel & set(self.packed)):
            raise ValueError(f"WeightPlan: row-parallel modules {packed} cannot be packed; pack column-parallel ones")
        for name in ("packed", "column_parallel", "row_parallel"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


@dataclass(frozen=True)
class FamilySpec:
    """One family's declaration; a subclass family overrides it with `dataclasses.replace`."""

    weights: WeightPlan
    norm: Callable[[int, float], nn.Module] = RMSNorm  # (dim, eps) -> a norm; Gemma: its (1 + w) form
    activation: Callable[[], nn.Module] = SiluAndMul  # the gated MLP's [gate | up] -> [I]; Gemma: GELU-tanh
    hidden_act: str = "silu"  # transformers' name for what `activation` computes; a config naming another is refused
    embedding_scale: EmbeddingScale | None = None
    # Bias on the q/k/v and on the o projections; None: the config's `attention_bias` (Qwen2 forces q/k/v).
    qkv_bias: bool | None = None
    o_bias: bool | None = None
