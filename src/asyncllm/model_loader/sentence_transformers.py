"""Reading a sentence-transformers checkpoint's own files: which pooling its `Pooling` module does, whether a
`Normalize` module follows, the prompts (instruction prefixes) it names, and where it truncates inputs.

modules.json lists the modules in order (a `Transformer`, then `Pooling` in e.g. 1_Pooling/, optionally
`Normalize`); 1_Pooling/config.json sets one `pooling_mode_*` flag; config_sentence_transformers.json holds
`prompts` ({name: text}) and `default_prompt_name`; the Transformer module's sentence_bert_config.json holds
`max_seq_length` (all-MiniLM-L6-v2: 256 of its 512 positions). A module or mode asyncllm does not compute
(Dense projections, max or weighted-mean pooling, mean pooling without the prompt's tokens) is refused, naming
it: an embedding that silently differs from the model's is worse than none. Plain Python; reads files only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncllm.errors import UnsupportedModelError
from asyncllm.pooling import PoolingMethod

_ST = "sentence_transformers.models."
_KNOWN_MODULES = {f"{_ST}Transformer", f"{_ST}Pooling", f"{_ST}Normalize"}
# 1_Pooling/config.json's flags, by the method each selects.
_MODES = {
    "pooling_mode_lasttoken": PoolingMethod.LAST,
    "pooling_mode_mean_tokens": PoolingMethod.MEAN,
    "pooling_mode_cls_token": PoolingMethod.CLS,
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class SentenceTransformersConfig:
    method: PoolingMethod | None  # None: no Pooling module's config (the architecture's default applies)
    normalizes: bool  # a Normalize module follows the pooling
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # sentence_bert_config.json's (None: it sets none)


def read_sentence_transformers(path: Path) -> SentenceTransformersConfig | None:
    """The checkpoint directory's sentence-transformers configuration; None where it has none (no
    modules.json, no 1_Pooling/config.json: not a sentence-transformers checkpoint)."""
    if not path.is_dir():
        return None
    modules = _read_json(path / "modules.json")
    pooling_dir = path / "1_Pooling"
    transformer_dir = path
    normalizes = False
    if modules is not None:
        if not isinstance(modules, list):
            raise UnsupportedModelError(f"{path / 'modules.json'} must list the model's modules")
        for module in modules:
            kind = module.get("type") if isinstance(module, dict) else None
            if kind not in _KNOWN_MODULES:
                raise UnsupportedModelError(
                    f"{path / 'modules.json'} names module {kind!r}, which asyncllm does not compute (it computes "
                    "Transformer, Pooling and Normalize): the embeddings would differ from the model's"
                )
            if kind == f"{_ST}Pooling":
                pooling_dir = path / str(module.get("path", "1_Pooling"))
            if kind == f"{_ST}Transformer":
                transformer_dir = path / str(module.get("path", ""))
            normalizes |= kind == f"{_ST}Normalize"
    pooling = _read_json(pooling_dir / "config.json")
    if modules is None and pooling is None:
        return None
    st = _read_json(path / "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise UnsupportedModelError(f"config_sentence_transformers.json's prompts must map names to texts: {prompts!r}")
    default = st.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise UnsupportedModelError(
            f"config_sentence_transformers.json's default_prompt_name={default!r} is not one of its prompts "
            f"({', '.join(map(repr, prompts)) or 'none'})"
        )
    method = _pooling_method(pooling, pooling_dir) if pooling is not None else None
    bert = _read_json(transformer_dir / "sentence_bert_config.json") or {}
    max_seq_length = bert.get("max_seq_length")
    if max_seq_length is not None and (type(max_seq_length) is not int or max_seq_length < 1):
        raise UnsupportedModelError(
            f"{transformer_dir / 'sentence_bert_config.json'}'s max_seq_length must be a positive integer, "
            f"got {max_seq_length!r}"
        )
    return SentenceTransformersConfig(method, normalizes, dict(prompts), default, max_seq_length)


def _pooling_method(config: dict[str, Any], where: Path) -> PoolingMethod:
    for flag in _UNSUPPORTED_MODES:
        if config.get(flag):
            raise UnsupportedModelError(
                f"{where / 'config.json'} sets {flag}: asyncllm pools by last token, mean or CLS only"
            )
    chosen = [method for flag, method in _MODES.items() if config.get(flag)]
    if len(chosen) != 1:
        raise UnsupportedModelError(
            f"{where / 'config.json'} must set exactly one of {', '.join(_MODES)} (asyncllm combines no two "
            f"pooling modes); it sets {len(chosen)}"
        )
    if chosen[0] is PoolingMethod.MEAN and config.get("include_prompt", True) is False:
        raise UnsupportedModelError(
            f"{where / 'config.json'} sets include_prompt=false (mean pooling without the prompt's tokens), "
            "which asyncllm does not compute"
        )
    return chosen[0]


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{path} is not readable JSON: {exc}") from exc
