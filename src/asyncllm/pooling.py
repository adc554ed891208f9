"""What embedding and scoring engines share across every layer: the engine's pooler (`PoolerSpec`, learned
when the checkpoint is opened), one request's options (`PoolingParams`), and the public results
(`EmbeddingOutput`, `RerankResult`).

Plain data, no torch: `PoolerSpec` travels in `RuntimeInfo` (across a core process's pipe too) and
`PoolingParams` in a `Request` down to the runner, which pools (`layers/pooler.py`). docs/embeddings.md.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from asyncllm.config_values import Task


class PoolingMethod(str, enum.Enum):
    """How a sequence's hidden states become one vector (sentence-transformers' `pooling_mode_*` names)."""

    LAST = "lasttoken"  # the last token's state: decoders (Qwen3-Embedding), vLLM's default for them
    MEAN = "mean"  # the mean over every token (all-MiniLM, e5)
    CLS = "cls"  # the first token's state: encoders (bge), vLLM's default for BertModel


class ScoreMethod(str, enum.Enum):
    """How a score engine turns (query, document) into one number."""

    CLASSIFIER = "classifier"  # a *ForSequenceClassification cross-encoder: sigmoid of its one logit
    YES_NO = "yes_no"  # a Qwen3-Reranker: P("yes") from the softmax over the "no" and "yes" logits
    COSINE = "cosine"  # an embed engine: the cosine similarity of the two embeddings (vLLM's)


@dataclass(frozen=True)
class PoolerSpec:
    """An embed or score engine's pooler, resolved once from the checkpoint (`model_loader/pooler_spec.py`)."""

    task: Task  # EMBED or SCORE, never GENERATE
    method: PoolingMethod
    hidden_size: int  # the pooled vector's size: an embedding's full `dimensions`
    # The checkpoint's modules.json ends with a Normalize module: every embedding leaves it normalised, as
    # sentence-transformers' does (whatever `normalize` a call asks for).
    normalizes: bool = False
    # config_sentence_transformers.json's `prompts` (name -> text put before an input) and the name applied
    # when a call names none (None: no prefix).
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    score: ScoreMethod | None = None  # set on score engines
    yes_no_token_ids: tuple[int, int] | None = None  # YES_NO: the ("no", "yes") token ids
    encoder: bool = False  # bidirectional (BERT): a cross-encoder reads (query, document) as a token-type pair
    type_vocab_size: int | None = None  # an encoder's token types (BERT: 2); the front refuses ids past them
    # sentence_bert_config.json's max_seq_length, where sentence-transformers truncates: without an explicit
    # max_model_len the engine's is the smaller of it and max_position_embeddings, as vLLM's is.
    max_seq_length: int | None = None

    @property
    def scores(self) -> bool:
        return self.task is Task.SCORE


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's options, checked by the front (`pooling_inputs.py`). `dimensions`: keep the
    first n values (Matryoshka), renormalised when `normalize`; None: all. `token_type_ids`: the input's
    segment ids (a cross-encoder's query/document pair), None: all 0."""

    dimensions: int | None = None
    normalize: bool = True
    token_type_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EmbeddingOutput:
    """One input's embedding: `embedding` (floats, `dimensions` of them), `num_prompt_tokens` (its tokens,
    after any prompt prefix and truncation)."""

    embedding: list[float]
    num_prompt_tokens: int


@dataclass(frozen=True)
class RerankResult:
    """One document's place in a `rerank`: its `index` in the documents given, its `relevance_score` and the
    `document` itself; results come best first."""

    index: int
    relevance_score: float
    document: str


def pooling_step_budget(max_num_batched_tokens: int, max_model_len: int) -> int:
    """The token budget of an embed or score engine's step. An input runs whole in one step (bidirectional
    attention and mean pooling need all of it at once), so the budget covers max_model_len, as vLLM's does
    for pooling models; more room than that only batches more inputs per step."""
    return max(max_num_batched_tokens, max_model_len)
