"""`SpeculativeConfig`: the `speculative_config` engine argument normalised, as vLLM spells it (methods, keys
and defaults), every value checked at construction with an `InvalidConfigError` naming the key. Split out of
config.py for size; plain Python, no torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Literal

from asyncllm.config_fields import invalid
from asyncllm.errors import InvalidConfigError
from asyncllm.validation import check_float, check_int, check_optional_int

__all__ = ["DEFAULT_MAX_SPECULATING_SEQS", "MAX_SPECULATIVE_TOKENS", "SpeculativeConfig"]

# Drafts per step: each is a logit row of its step, so past a handful most are rejected anyway.
MAX_SPECULATIVE_TOKENS = 16
# Speculation pauses while more requests than this run (`disable_by_batch_size` unset): a step of many rows is
# bound by compute, not by reading the weights, so drafts no longer ride for free, and a step that verifies
# drafts cannot be overlapped with the planning of the next (its accepted tokens decide that step's inputs).
DEFAULT_MAX_SPECULATING_SEQS = 32
_SPEC_KEYS = {
    "draft_model": ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "disable_by_batch_size"),
    "eagle3": ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "disable_by_batch_size"),
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"),
    "suffix": (
        "method",
        "num_speculative_tokens",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
        "disable_by_batch_size",
    ),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config` normalised (vLLM's spelling and defaults; docs/API.md, "Speculative decoding").

    "ngram": drafts of up to `num_speculative_tokens` copied from the request's own tokens after the latest
    earlier occurrence of its last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.
    "suffix": drafts from what followed the longest suffix of the request's tokens, in its own tokens or in
    recent requests' outputs (core/spec/suffix.py; the suffix_decoding_* keys).
    "draft_model": drafts from `model`, a smaller checkpoint with the target's vocabulary, run greedily by the
    runner after each step (worker/draft_model.py); its path is checked here, its config when the engine
    builds (worker/draft_setup.py).
    "eagle3": drafts from `model`, an EAGLE-3 head (a directory as vLLM and SGLang load it) fed the target's
    hidden states, run greedily by the runner after each step (worker/eagle3.py); its path is checked here, its
    tensors and config against the target when the engine builds (worker/eagle3_setup.py)."""

    method: Literal["ngram", "suffix", "draft_model", "eagle3"]
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None  # the draft checkpoint ("draft_model") or head directory ("eagle3")
    # Any method: speculation pauses for a step while more requests than this run (None: the default,
    # `DEFAULT_MAX_SPECULATING_SEQS`); vLLM's key.
    disable_by_batch_size: int | None = None

    @property
    def max_speculating_seqs(self) -> int:
        """The most running requests a step may draft for; past it every request decodes as without speculation
        (overlapped with the planning of the next step) until the batch shrinks again."""
        return self.disable_by_batch_size if self.disable_by_batch_size is not None else DEFAULT_MAX_SPECULATING_SEQS

    @property
    def runs_model(self) -> bool:
        """Whether the runner drafts with a model of its own (the core keeps its proposals)."""
        return self.method in ("draft_model", "eagle3")

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """A dict as vLLM spells it, its JSON text (the command line's), a `SpeculativeConfig` or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        name = "speculative_config"
        example = '{"method": "ngram", "num_speculative_tokens": 4}'
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid(name, value, f"a JSON object such as {example}") from None
        if not isinstance(value, dict):
            raise invalid(name, value, f"a dict such as {example}, or None")
        method = value.get("method")
        if method is None and "model" in value:  # vLLM's reading of a config that names a draft alone
            method, value = "draft_model", {**value, "method": "draft_model"}
        if method not in _SPEC_KEYS:
            raise invalid(f"{name}['method']", method, "'ngram', 'suffix', 'draft_model' or 'eagle3'")
        unknown = sorted(set(value) - set(_SPEC_KEYS[method]))
        if unknown:
            keys = ", ".join(_SPEC_KEYS[method])
            raise InvalidConfigError(f"{name} has unknown key {unknown[0]!r} for method {method!r}: use {keys}")
        if method in ("draft_model", "eagle3"):
            config = cls._draft_model(value, method)
        else:
            config = cls._suffix(value) if method == "suffix" else cls._ngram(value)
        key, allowed = f"{name}['disable_by_batch_size']", "an integer >= 1 (running requests), or None"
        limit = check_optional_int(invalid, key, value.get("disable_by_batch_size"), allowed, lo=1)
        return dataclasses.replace(config, disable_by_batch_size=limit)

    @classmethod
    def _draft_model(cls, value: dict[str, Any], method: Literal["draft_model", "eagle3"]) -> SpeculativeConfig:
        name = "speculative_config"
        k = _num_tokens(value.get("num_speculative_tokens"))
        tp = value.get("draft_tensor_parallel_size", 1)
        if tp is not None and (type(tp) is not int or tp != 1):  # 1 exactly: not True, not 1.0
            raise invalid(f"{name}['draft_tensor_parallel_size']", tp, "1 (the draft runs on the target's device)")
        model = value.get("model")
        if isinstance(model, PurePath):
            model = str(model)
        key = f"{name}['model']"
        if method == "eagle3":  # a head's directory: config.json and safetensors
            if not isinstance(model, str) or not model or not (Path(model).expanduser() / "config.json").is_file():
                raise invalid(key, model, "an EAGLE-3 head's directory (config.json and safetensors): no such head")
            return cls("eagle3", k, model=model)
        if not isinstance(model, str) or not model:
            raise invalid(key, model, "the draft checkpoint's path (a directory or a .gguf file)")
        path = Path(model).expanduser()
        if not ((path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf")):
            raise invalid(key, model, "a checkpoint directory (with config.json) or a .gguf file: no such model")
        return cls("draft_model", k, model=model)

    @classmethod
    def _ngram(cls, value: dict[str, Any]) -> SpeculativeConfig:
        name = "speculative_config"
        k = _num_tokens(value.get("num_speculative_tokens"))
        lo = check_int(
            invalid, f"{name}['prompt_lookup_min']", value.get("prompt_lookup_min", 2), "an integer >= 1", lo=1
        )
        bounds = f"an integer in [prompt_lookup_min={lo}, 32]"
        hi = check_int(
            invalid, f"{name}['prompt_lookup_max']", value.get("prompt_lookup_max", max(lo, 5)), bounds, lo=lo
        )
        if hi > 32:
            raise invalid(f"{name}['prompt_lookup_max']", hi, bounds)
        return cls("ngram", k, lo, hi)

    @classmethod
    def _suffix(cls, value: dict[str, Any]) -> SpeculativeConfig:
        name = "speculative_config"
        key = f"{name}['suffix_decoding_max_tree_depth']"
        depth = check_int(invalid, key, value.get("suffix_decoding_max_tree_depth", 24), "an integer in [2, 64]", lo=2)
        if depth > 64:
            raise invalid(key, depth, "an integer in [2, 64]")
        # vLLM's default draft length is the tree's depth; ours is capped where drafts stop paying.
        k = _num_tokens(value.get("num_speculative_tokens", min(depth - 1, MAX_SPECULATIVE_TOKENS)))
        if k >= depth:
            raise invalid(f"{name}['num_speculative_tokens']", k, f"fewer than suffix_decoding_max_tree_depth={depth}")
        key = f"{name}['suffix_decoding_max_cached_requests']"
        cached = check_int(
            invalid, key, value.get("suffix_decoding_max_cached_requests", 10_000), "an integer >= 0", lo=0
        )
        key = f"{name}['suffix_decoding_max_spec_factor']"
        factor = check_float(
            invalid, key, value.get("suffix_decoding_max_spec_factor", 1.0), "a number > 0", lo=0.0, lo_open=True
        )
        key = f"{name}['suffix_decoding_min_token_prob']"
        prob = check_float(
            invalid, key, value.get("suffix_decoding_min_token_prob", 0.1), "a number in [0, 1]", lo=0.0, hi=1.0
        )
        return cls("suffix", k, 2, 5, depth, cached, factor, prob)


def _num_tokens(value: object) -> int:
    key, allowed = "speculative_config['num_speculative_tokens']", f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
    k = check_int(invalid, key, value, allowed, lo=1)
    if k > MAX_SPECULATIVE_TOKENS:
        raise invalid(key, k, allowed)
    return k
