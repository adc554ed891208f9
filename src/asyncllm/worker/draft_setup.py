"""`load_draft`: the draft model of `speculative_config={"method": "draft_model", "model": ...}`, opened, checked
against the target and loaded beside it, on its device and in its dtype, with an attention backend of its own
(its heads may differ from the target's). A draft that cannot serve this target fails here, while the engine
is built, with a one-line `InvalidConfigError` naming `speculative_config['model']`: not a checkpoint asyncllm
runs, another vocabulary, or fewer positions than the target's `max_model_len`.

Its KV cache is sized with the target's (`LoadedDraft.kv_spec`: every block id holds a block in each) and
allocated by `make_draft_model`. Knows nothing of steps or requests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import AsyncLLMError, InvalidConfigError
from asyncllm.layers.fusion import use_fused_kernels
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.model_loader.loader import load_model
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.draft_backend import draft_attention_backend
from asyncllm.worker.draft_model import DraftModel, LoadedDraft
from asyncllm.worker.eagle3 import Eagle3Drafter, LoadedEagle3
from asyncllm.worker.eagle3_setup import load_eagle3
from asyncllm.worker.kv_cache import KVCacheSpec

__all__ = ["LoadedDraft", "LoadedEagle3", "draft_bytes", "load_draft", "make_draft_model"]

_KEY = "speculative_config['model']"


def load_draft(
    config: EngineConfig, target: Checkpoint, resolved: ResolvedModel, module: CausalLM, first_rank: bool = True
) -> LoadedDraft | LoadedEagle3 | None:
    """The draft model (or "eagle3"'s head: worker/eagle3_setup.py), loaded; None unless `speculative_config`'s
    method runs one. `first_rank`: this rank checks the draft's vocabulary against the target's tokenizer (the
    others, whose tokenizer is not loaded, leave it to rank 0: the same files)."""
    spec = config.scheduler_config.speculative
    if first_rank and spec is not None and spec.method in ("draft_model", "eagle3"):
        # Its set-up imports transformers: not while a background tokenizer load may import it too.
        target.loaded_tokenizer()
    if spec is not None and spec.method == "eagle3":
        return load_eagle3(config, module, resolved)
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None  # SpeculativeConfig checked it
    try:
        return _load(config, spec.model, spec.num_speculative_tokens, target, resolved, first_rank)
    except InvalidConfigError:
        raise
    except AsyncLLMError as exc:  # not a model asyncllm runs: its loader says why
        raise InvalidConfigError(f"{_KEY}={spec.model!r} cannot be the draft: {exc}") from None


def _load(
    config: EngineConfig, path: str, k: int, target: Checkpoint, resolved: ResolvedModel, first_rank: bool
) -> LoadedDraft:
    checkpoint = open_checkpoint(path, torch.float32)
    draft = _resolve(config, checkpoint, resolved)
    if first_rank:
        _check_vocabulary(path, target, checkpoint)
    device, dtype = resolved.device, resolved.dtype
    arch = draft.arch
    backend = draft_attention_backend(config, arch, resolved)
    mc = config.model_config
    model = load_model(checkpoint, arch, backend, device, dtype, mc.load_format, mc.seed, None, draft.quant)
    if backend.name == "triton":  # the same fused layers as the target's with this backend
        use_fused_kernels(model)
    kv_spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, config.cache_config.block_size, dtype)
    return LoadedDraft(model, backend, kv_spec, k)


def _resolve(config: EngineConfig, checkpoint: Checkpoint, target: ResolvedModel) -> ResolvedModel:
    """The draft's architecture and quantization, checked against the target's limits; the target's device
    and dtype."""
    positions = getattr(checkpoint.hf_config, "max_position_embeddings", None)
    limit = target.arch.max_model_len
    if isinstance(positions, int) and positions < limit:
        raise InvalidConfigError(
            f"{_KEY}: the draft's max_position_embeddings ({positions}) is shorter than the target's "
            f"max_model_len ({limit}): use a draft with as many positions, or max_model_len <= {positions}"
        )
    resolved = ResolvedModel.resolve(config, checkpoint.hf_config)
    arch = ModelArchConfig.from_hf(checkpoint.hf_config, limit)  # its RoPE tables cover the target's positions
    vocab, target_vocab = arch.vocab_size, target.arch.vocab_size
    if vocab != target_vocab:
        raise InvalidConfigError(
            f"{_KEY}: the draft's vocabulary has {vocab} entries, the target's {target_vocab}: a draft must share "
            "the target's tokenizer"
        )
    if arch.kv_window is not None:  # the block manager frees blocks behind the target's window alone
        raise InvalidConfigError(
            f"{_KEY}: a draft whose every layer slides (sliding_window={arch.kv_window}) is not supported: use a "
            "draft with full attention"
        )
    device, dtype = target.device, target.dtype
    return dataclasses.replace(resolved, device=device, dtype=dtype, arch=arch, kv_cache_dtype=dtype)


def _check_vocabulary(model: str, target: Checkpoint, draft: Checkpoint) -> None:
    """Where both checkpoints carry a tokenizer, the same token strings have the same ids."""
    theirs, ours = _vocab(draft.tokenizer), _vocab(target.loaded_tokenizer())
    if theirs is not None and ours is not None and theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[0]
        raise InvalidConfigError(
            f"{_KEY}={model!r}: the draft's tokenizer differs from the target's (token {differ[0]!r}): a draft "
            "must share the target's tokenizer"
        )


def _vocab(tokenizer: Any | None) -> dict[str, int] | None:
    get = getattr(tokenizer, "get_vocab", None)
    return dict(get()) if get is not None else None


def draft_bytes(draft: LoadedDraft | LoadedEagle3 | None) -> int:
    """What each block id holds in the draft's cache (0 without a draft): sized within the target's budget."""
    return draft.kv_spec.bytes_per_block if draft is not None else 0


def make_draft_model(
    loaded: LoadedDraft | LoadedEagle3 | None,
    num_blocks: int,
    max_num_seqs: int,
    max_seq_len: int,
    device: torch.device,
) -> DraftModel | Eagle3Drafter | None:
    """The runner's draft model (or EAGLE-3 head), its cache allocated (None without one)."""
    if isinstance(loaded, LoadedEagle3):
        return Eagle3Drafter.create(loaded, num_blocks, max_num_seqs, max_seq_len, device)
    return None if loaded is None else DraftModel.create(loaded, num_blocks, max_num_seqs, max_seq_len, device)
