"""Facts learned when the model is loaded and the KV cache sized: runtime state, never config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeInfo:
    vocab_size: int  # rows of the embedding: valid token ids are [0, vocab_size)
    max_model_len: int  # the configured (or model's) limit on prompt + output tokens
    num_kv_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    device: str  # "cpu" or "cuda:N"
    dtype: str  # "float32", "bfloat16", ...

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_seq_len(self) -> int:
        """The longest sequence that can actually run: the model limit or the whole KV cache, if smaller."""
        return min(self.max_model_len, self.kv_capacity_tokens)
