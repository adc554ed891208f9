"""Task resolution: what an engine serves (`task`, or what the checkpoint says) and, for an embed or score
engine, its pooler (`PoolerSpec`), decided once from the checkpoint before anything is loaded.

`task=None` resolves as vLLM's runner "auto" does: sentence-transformers files (modules.json,
1_Pooling/config.json) -> "embed"; a `*ForSequenceClassification` architecture -> "score"; an encoder
(BertModel) -> "embed"; else "generate". Without sentence-transformers files an embedding pools as vLLM's
defaults do: a decoder's last token (vLLM's LAST for converted causal LMs), an encoder's CLS (vLLM's
BertModel). `task="score"` on a Qwen3ForCausalLM is the Qwen3-Reranker: P("yes") at the last token.
"""

from __future__ import annotations

from typing import Any

from asyncllm.config import EngineConfig
from asyncllm.config_values import Task
from asyncllm.errors import InvalidConfigError, UnsupportedModelError
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.sentence_transformers import read_sentence_transformers
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_architecture
from asyncllm.pooling import PoolerSpec, PoolingMethod, ScoreMethod

# The decoders whose checkpoints score as yes/no rerankers (the Qwen3-Reranker's published form).
YES_NO_RERANKERS = frozenset({"Qwen3ForCausalLM"})


def engine_pooler(config: EngineConfig, checkpoint: Checkpoint) -> PoolerSpec | None:
    """`resolve_pooler` for an engine's config; InvalidConfigError for an embed or score engine asked for
    what only generation has (tensor parallelism, LoRA adapters, speculative decoding, KV tiers)."""
    arch = ModelArchConfig.from_hf(checkpoint.hf_config, config.model_config.max_model_len)
    spec = resolve_pooler(config.model_config.task, checkpoint, arch)
    if spec is not None:
        refused = {
            "tensor_parallel_size > 1": config.parallel_config.tensor_parallel_size > 1,
            "enable_lora=True": config.lora_config.enable_lora,
            "speculative_config": config.scheduler_config.speculative is not None,
            # KV tiers keep prefix-cached blocks, and these engines cache no prefix (core/pooling.py)
            "kv_offloading_size > 0": config.cache_config.kv_offloading_size > 0,
            "kv_cache_dir": config.cache_config.kv_cache_dir is not None,
        }
        for what, asked in refused.items():
            if asked:
                raise InvalidConfigError(
                    f"{what} is for generation; this engine serves task={spec.task.value!r}: leave it out"
                )
    return spec


def resolve_pooler(task: Task | None, checkpoint: Checkpoint, arch: ModelArchConfig) -> PoolerSpec | None:
    """The engine's pooler, or None for a generation engine. InvalidConfigError for a `task` the checkpoint
    cannot serve; UnsupportedModelError for sentence-transformers modules asyncllm does not compute."""
    entry = resolve_architecture(arch.architecture)
    name, encoder, classifier = entry.name, entry.is_encoder, entry.classifies
    st = read_sentence_transformers(checkpoint.path)
    if task is None:
        if st is not None or (encoder and not classifier):
            task = Task.EMBED
        else:
            task = Task.SCORE if classifier else Task.GENERATE
    if task is Task.GENERATE:
        if encoder:
            raise InvalidConfigError(
                f"task='generate' cannot be served by {name}: it is an encoder (no generation); use task='embed'"
                + (" or task='score'" if classifier else "")
            )
        return None
    if task is Task.EMBED:
        method = st.method if st is not None and st.method is not None else _default_method(encoder)
        return PoolerSpec(
            Task.EMBED,
            method,
            arch.hidden_size,
            normalizes=st is not None and st.normalizes,
            prompts=st.prompts if st is not None else {},
            default_prompt_name=st.default_prompt_name if st is not None else None,
            encoder=encoder,
            type_vocab_size=arch.encoder.type_vocab_size if arch.encoder is not None else None,
            max_seq_length=st.max_seq_length if st is not None else None,
        )
    if classifier:
        num_labels = arch.encoder.num_labels if arch.encoder is not None else None
        if num_labels != 1:
            raise UnsupportedModelError(
                f"{name} has {num_labels} labels: task='score' reads a cross-encoder's one logit (num_labels=1)"
            )
        return PoolerSpec(
            Task.SCORE,
            PoolingMethod.CLS,
            arch.hidden_size,
            score=ScoreMethod.CLASSIFIER,
            encoder=True,
            type_vocab_size=arch.encoder.type_vocab_size if arch.encoder is not None else None,
        )
    if name in YES_NO_RERANKERS:
        tokenizer = checkpoint.loaded_tokenizer()  # the yes/no ids: waits for one loading in the background
        return PoolerSpec(
            Task.SCORE,
            PoolingMethod.LAST,
            arch.hidden_size,
            score=ScoreMethod.YES_NO,
            yes_no_token_ids=(_token_id(tokenizer, "no"), _token_id(tokenizer, "yes")),
        )
    raise InvalidConfigError(
        f"task='score' cannot be served by {name}: scores come from a cross-encoder (*ForSequenceClassification) "
        f"or a yes/no reranker ({', '.join(sorted(YES_NO_RERANKERS))}); use task='embed' for cosine similarity"
    )


def _default_method(encoder: bool) -> PoolingMethod:
    return PoolingMethod.CLS if encoder else PoolingMethod.LAST


def _token_id(tokenizer: Any, token: str) -> int:
    """The id of `token` as one vocabulary entry (the reranker's answers, "yes" and "no")."""
    if tokenizer is None:
        raise UnsupportedModelError("a yes/no reranker needs its tokenizer (to find the 'yes' and 'no' tokens)")
    vocab = tokenizer.get_vocab()
    if token not in vocab:
        raise UnsupportedModelError(
            f"the tokenizer has no {token!r} token: task='score' on a decoder reads the logits of 'yes' and 'no'"
        )
    return int(vocab[token])
