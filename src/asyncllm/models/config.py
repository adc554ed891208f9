"""The architecture facts a model needs, read once from a Hugging Face config and validated.

Owns the translation from the many spellings transformers configs use (rope_parameters vs rope_theta +
rope_scaling, per-layer-type rope parameters, optional head_dim, sliding-window flags and layer types) into
one frozen `ModelArchConfig`. Knows nothing about devices, dtypes, KV caches or the engine; plain Python, no
torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncllm.errors import InvalidConfigError, UnsupportedModelError
from asyncllm.models.encoder_config import ENCODER_ACTIVATIONS, EncoderArch, read_encoder

_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE rescaling (transformers' rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: Literal["llama3"] = field(default="llama3", init=False)

    def __post_init__(self) -> None:
        if self.high_freq_factor <= self.low_freq_factor:
            raise UnsupportedModelError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}: the checkpoint's config is malformed"
            )


@dataclass(frozen=True)
class MoEArch:
    """A sparse mixture-of-experts MLP (Qwen3-MoE): each token's `top_k` of `num_experts` SiLU-gated experts."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each expert's (moe_intermediate_size)
    renormalize: bool  # norm_topk_prob: the top-k routing probabilities rescaled to sum to 1
    dense_layers: frozenset[int] = frozenset()  # layers with the dense MLP instead (mlp_only_layers, sparse step)

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(f"model config MoE {name}={value!r} is invalid: expected an int >= 1")
        if self.top_k > self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.top_k} exceeds num_experts={self.num_experts}: the config is malformed"
            )


@dataclass(frozen=True)
class LinearRopeScaling:
    """Every frequency divided by `factor` (transformers' rope_type "linear"; Gemma 3's global layers)."""

    factor: float
    rope_type: Literal["linear"] = field(default="linear", init=False)

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise UnsupportedModelError(f"linear rope scaling needs factor > 0, got {self.factor!r}")


RopeScaling = Llama3RopeScaling | LinearRopeScaling


@dataclass(frozen=True)
class ModelArchConfig:
    """One architecture's shape and numerics (a decoder's; an encoder's with `encoder` set); `max_model_len`
    bounds the positions served."""

    architecture: str  # hf_config.architectures[0], e.g. "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # config.head_dim when given (it may differ from hidden_size / num_heads)
    intermediate_size: int
    rms_norm_eps: float  # the norms' epsilon (an encoder's: its layer_norm_eps, as `encoder` holds it)
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain RoPE
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v/o projections (Qwen2 forces q/k/v bias in its model class)
    mlp_bias: bool
    max_position_embeddings: int
    max_model_len: int  # the longest sequence the engine will run; the RoPE tables cover it
    # Numerics some families read from their config; None: not applied (see models/family.py).
    query_pre_attn_scalar: float | None = None  # softmax scale query_pre_attn_scalar ** -0.5 (Gemma)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    moe: MoEArch | None = None  # None: every layer's MLP is dense
    hidden_act: str = "silu"  # the gated MLP's activation, as transformers names it (the family must compute it)
    # Each layer's sliding window as configured (keys within `window` positions of the query, itself
    # included), None for a layer that attends to every key; () when none slides. `layer_window` gives the
    # window that binds.
    layer_windows: tuple[int | None, ...] = ()
    # The sliding layers' rotary base when it differs from rope_theta (Gemma 3's local layers: 10,000, unscaled);
    # None: every layer rotates with rope_theta and rope_scaling.
    local_rope_theta: float | None = None
    # A bidirectional encoder's own fields (BERT: token types, absolute positions, a classifier's labels; its
    # rope fields are unused); None: a decoder.
    encoder: EncoderArch | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "max_model_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(f"model config {name}={value!r} is invalid: expected an int >= 1")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads="
                f"{self.num_kv_heads}: grouped-query attention needs whole groups"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} is odd: rotary embeddings need it even")
        if not self.rms_norm_eps > 0:
            raise UnsupportedModelError(f"rms_norm_eps={self.rms_norm_eps!r} is invalid: expected > 0")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UnsupportedModelError(f"model config {name}={value!r} is invalid: expected > 0 or None")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"model config has {len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        for window in self.layer_windows:
            if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise UnsupportedModelError(f"model config sliding_window={window!r} is invalid: expected an int >= 1")

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` is a sliding-window layer (Gemma 3 rotates those with its local rope base,
        whether or not the window binds)."""
        return bool(self.layer_windows) and self.layer_windows[layer] is not None

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window where it binds; None: it sees every earlier key (a global layer, or a
        window of max_model_len or more, which no sequence outgrows)."""
        window = self.layer_windows[layer] if self.layer_windows else None
        return window if window is not None and window < self.max_model_len else None

    @property
    def kv_window(self) -> int | None:
        """The window beyond which no layer reads a key again, when every layer's binds (Mistral's): keys more
        than this far behind every query left to compute are dead. None: some layer sees every key."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        if any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    @classmethod
    def from_hf(cls, hf_config: Any, max_model_len: int | None, default_limit: int | None = None) -> ModelArchConfig:
        """Read a transformers config; `max_model_len=None` means the model's max_position_embeddings, or
        `default_limit` where that is smaller (a sentence-transformers checkpoint's max_seq_length).

        The loaders check the architecture against the registry first (`model_loader.hf.check_architecture`);
        a config lacking a field every supported family has still fails as `UnsupportedModelError`."""
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise UnsupportedModelError("the checkpoint's config.json names no `architectures`")
        architecture = architectures[0]

        def required(name: str) -> Any:
            value = getattr(hf_config, name, None)
            if value is None:
                raise UnsupportedModelError(f"the {architecture} config has no {name}: not a model asyncllm runs")
            return value

        # Gemma spells it hidden_activation (its hidden_act, when present, is a legacy field it ignores).
        hidden_act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
        encoder = read_encoder(hf_config)
        activations = _ACTIVATIONS if encoder is None else tuple(ENCODER_ACTIVATIONS)
        if hidden_act not in activations:
            raise UnsupportedModelError(
                f"hidden_act={hidden_act!r} is not supported; supported: {', '.join(map(repr, activations))}"
            )
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(
                "use_bidirectional_attention=True (an embedding model's bidirectional attention) is not supported: "
                "asyncllm serves causal language models"
            )
        hidden = required("hidden_size")
        heads = required("num_attention_heads")
        max_pos = required("max_position_embeddings")
        if max_model_len is not None:
            model_len = max_model_len
        else:
            model_len = max_pos if default_limit is None else min(max_pos, default_limit)
        if model_len > max_pos:
            # RoPE past the trained length gives silently degraded output, unless a scaling was trained in.
            raise InvalidConfigError(
                f"max_model_len={model_len} exceeds the model's max_position_embeddings ({max_pos}); "
                f"use max_model_len <= {max_pos}"
            )
        num_layers = required("num_hidden_layers")
        windows = _layer_windows(hf_config, num_layers)
        (theta, scaling), local = _read_rope(hf_config, max_pos)
        local_theta = None
        if local is not None and any(w is not None for w in windows):
            local_theta, local_scaling = local
            if local_scaling is not None:
                raise UnsupportedModelError(
                    f"rope scaling on sliding layers ({local_scaling}) is not supported; only their rope_theta is"
                )
        return cls(
            architecture=architecture,
            vocab_size=required("vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hidden // heads,
            intermediate_size=required("intermediate_size"),
            rms_norm_eps=float(required("rms_norm_eps")) if encoder is None else encoder.layer_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            max_position_embeddings=max_pos,
            max_model_len=model_len,
            query_pre_attn_scalar=_optional_float(hf_config, "query_pre_attn_scalar"),
            final_logit_softcapping=_optional_float(hf_config, "final_logit_softcapping"),
            moe=_read_moe(hf_config, num_layers, required),
            hidden_act=hidden_act,
            layer_windows=windows,
            local_rope_theta=local_theta,
            encoder=encoder,
        )


_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _optional_float(hf_config: Any, name: str) -> float | None:
    value = getattr(hf_config, name, None)
    return None if value is None else float(value)


def _read_moe(hf_config: Any, num_layers: int, required: Callable[[str], Any]) -> MoEArch | None:
    """The experts of a MoE config (transformers' Qwen3-MoE fields), None for a dense model. A layer is dense
    when listed in `mlp_only_layers` or off the `decoder_sparse_step` grid, as transformers builds it."""
    num_experts = getattr(hf_config, "num_experts", None)
    if not num_experts:  # absent, or 0: transformers then builds every layer dense
        return None
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    only = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return MoEArch(
        num_experts=num_experts,
        top_k=required("num_experts_per_tok"),
        intermediate_size=required("moe_intermediate_size"),
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        dense_layers=frozenset(i for i in range(num_layers) if i in only or (i + 1) % step),
    )


_Rope = tuple[float, RopeScaling | None]  # (theta, scaling)


def _read_rope(hf_config: Any, max_position_embeddings: int) -> tuple[_Rope, _Rope | None]:
    """((theta, scaling), the sliding layers' (theta, scaling) or None) from `rope_parameters` (transformers
    5; per layer type for Gemma 3: "full_attention" and "sliding_attention") or `rope_theta` + `rope_scaling`
    (older)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown or "full_attention" not in params:
            raise UnsupportedModelError(f"per-layer-type rope parameters {params!r} are not supported")
        local = params.get("sliding_attention")
        glob = _read_rope_params(hf_config, dict(params["full_attention"]), max_position_embeddings)
        return glob, None if local is None else _read_rope_params(hf_config, dict(local), max_position_embeddings)
    return _read_rope_params(hf_config, params, max_position_embeddings), None


def _read_rope_params(hf_config: Any, params: dict[str, Any], max_position_embeddings: int) -> _Rope:
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or _DEFAULT_ROPE_THETA
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor={partial!r} is not supported; only full rotary is")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        if "factor" not in params:
            raise UnsupportedModelError(f"linear rope parameters lack 'factor': got {params!r}")
        return float(theta), LinearRopeScaling(float(params["factor"]))
    if rope_type == "llama3":
        try:
            scaling = Llama3RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(
                    params.get("original_max_position_embeddings") or max_position_embeddings
                ),
            )
        except KeyError as missing:
            raise UnsupportedModelError(f"llama3 rope parameters lack {missing}: got {params!r}") from None
        return float(theta), scaling
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported; supported rope types: 'default', 'linear', 'llama3'"
    )


def _layer_windows(hf_config: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: `layer_types` names the sliding layers (Gemma 3,
    Qwen2/3 with use_sliding_window); without it a configured `sliding_window` slides every layer (Mistral).
    () when no layer slides."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:  # Qwen2/3 keep a window they do not use
        window = None
    if window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"model config sliding_window={window!r} is invalid: expected an int >= 1")
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention"] * num_layers
    if len(layer_types) != num_layers or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(
            f"layer_types={list(layer_types)!r} is not supported: expected {num_layers} entries, each "
            "'sliding_attention' or 'full_attention'"
        )
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return windows if any(w is not None for w in windows) else ()
