"""An embed or score call's inputs made into checked pooling `Request`s, shared by both fronts (`LLM`,
`AsyncLLMEngine`): the cheap checks (`embed_plan`, `score_plan`: types, counts, options, the engine's task)
in the caller's thread, tokenizing (`embed_ids`, `score_ids`: one batch call, which releases the GIL) where
the caller can afford it, then the length and vocabulary checks (`request`).

What an input becomes: an embedding's text gets the checkpoint's prompt (config_sentence_transformers.json,
by `prompt_name`) in front, then is tokenized as the tokenizer's own call would (special tokens added); a
cross-encoder's (query, document) pair is tokenized as a pair (its token types 0 then 1); a yes/no
reranker's pair is its model card's template (`RERANKER_PREFIX` ...). Plain Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncllm.config_values import Task
from asyncllm.core.detokenizer import backend_tokenizer
from asyncllm.core.request import Request
from asyncllm.errors import InvalidRequestError
from asyncllm.input_processor import InputProcessor
from asyncllm.pooling import PoolerSpec, PoolingParams, RerankResult, ScoreMethod
from asyncllm.sampling_params import SamplingParams
from asyncllm.validation import is_int, short_repr

# The Qwen3-Reranker's prompt, as its model card writes it (huggingface.co/Qwen/Qwen3-Reranker-0.6B, "Usage";
# the same in vLLM's Qwen3-Reranker examples): a system turn asking for "yes" or "no", the user turn
# "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}", and an assistant turn opened with an
# empty think block. Prefix, pair and suffix are tokenized apart, without special tokens, as the card does.
RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_SCORE_PARAMS = PoolingParams()
_DEFAULTS = SamplingParams(max_tokens=1)  # what a pooling request's (unused) sampling fields hold


@dataclass(frozen=True)
class EmbedPlan:
    """An embed call's inputs and options, checked: texts get `prefix`; ids are kept as given."""

    inputs: list[str | list[int]]
    params: PoolingParams
    prefix: str
    truncate: int | None  # keep the last this many tokens; None: refuse longer inputs


@dataclass(frozen=True)
class ScorePlan:
    query: str
    documents: list[str]
    instruction: str | None  # a yes/no reranker's (None: its default)


class PoolingInputs:
    def __init__(self, processor: InputProcessor, tokenizer: Any, max_token_chars: int | None) -> None:
        self.processor = processor
        self.runtime = processor.runtime
        self.tokenizer = tokenizer
        self._max_token_chars = max_token_chars

    # ------------------------------------------------------------------ the engine's task
    def check_generates(self, call: str) -> None:
        """A generation call (add_request, generate, chat) on an embed or score engine is refused."""
        task = self.runtime.task
        if task is not Task.GENERATE:
            what = "embed()" if task is Task.EMBED else "score() and rerank()"
            raise InvalidRequestError(
                f"{call} generates text, but this engine serves task={task.value!r}: call {what}, or start an "
                "engine with task='generate' for text"
            )

    def spec_for(self, call: str, *tasks: Task) -> PoolerSpec:
        """This engine's pooler, if its task serves `call`; else InvalidRequestError naming both."""
        spec = self.runtime.pooler
        if spec is None or spec.task not in tasks:
            served = self.runtime.task.value
            wanted = " or ".join(repr(t.value) for t in tasks)
            raise InvalidRequestError(
                f"{call} needs an engine with task={wanted}; this one serves task={served!r} (its model, and "
                "what it computes, are chosen when the engine starts: docs/embeddings.md)"
            )
        return spec

    # ------------------------------------------------------------------ embed
    def embed_plan(
        self,
        inputs: object,
        dimensions: object = None,
        normalize: object = True,
        prompt_name: object = None,
        truncate_prompt_tokens: object = None,
    ) -> EmbedPlan:
        spec = self.spec_for("embed()", Task.EMBED)
        items = _as_inputs(inputs)
        if dimensions is not None and (not is_int(dimensions) or not 1 <= dimensions <= spec.hidden_size):  # type: ignore[operator]
            raise InvalidRequestError(
                f"dimensions={short_repr(dimensions)} is invalid: give an integer from 1 to {spec.hidden_size} "
                "(this model's embedding size; Matryoshka models keep their first values), or None for all"
            )
        if not isinstance(normalize, bool):
            raise InvalidRequestError(f"normalize={short_repr(normalize)} is invalid: give True or False")
        truncate = self._truncation(truncate_prompt_tokens)
        prefix = self._prefix(spec, prompt_name, items)
        for i, item in enumerate(items):
            if isinstance(item, str):
                self._check_text(f"input {i}", item)
        params = PoolingParams(dimensions, normalize)  # type: ignore[arg-type]
        return EmbedPlan(items, params, prefix, truncate)

    def embed_ids(self, plan: EmbedPlan) -> list[list[int]]:
        """Each input's token ids (texts tokenized in one batch, their prompt in front), truncated as asked."""
        texts = [(i, plan.prefix + x) for i, x in enumerate(plan.inputs) if isinstance(x, str)]
        ids: list[list[int]] = [x if isinstance(x, list) else [] for x in plan.inputs]
        if texts:
            for (i, _), encoded in zip(texts, self.processor.encode_texts([t for _, t in texts])):
                ids[i] = encoded
        if plan.truncate is not None:
            # The last tokens, as vLLM's truncate_prompt_tokens keeps; a text keeps the special tokens its
            # tokenizer puts in front (BERT's [CLS], which CLS pooling reads), as left truncation does there.
            head = self._special_prefix() if texts else 0
            ids = [
                _keep_last(x, plan.truncate, head if isinstance(src, str) else 0) for x, src in zip(ids, plan.inputs)
            ]
        return ids

    # ------------------------------------------------------------------ score, rerank
    def score_plan(self, query: object, documents: object, instruction: object = None) -> ScorePlan:
        spec = self.spec_for("score() and rerank()", Task.SCORE, Task.EMBED)
        if not isinstance(query, str) or not query:
            raise InvalidRequestError(f"query={short_repr(query)} is invalid: give a non-empty string")
        docs = [documents] if isinstance(documents, str) else documents
        if not isinstance(docs, (list, tuple)) or not docs:
            raise InvalidRequestError(
                f"documents={short_repr(documents)} is invalid: give a string or a non-empty list of strings"
            )
        self._check_text("query", query)
        for i, doc in enumerate(docs):
            if not isinstance(doc, str) or not doc:
                raise InvalidRequestError(f"documents[{i}]={short_repr(doc)} is invalid: give a non-empty string")
            self._check_text(f"documents[{i}]", doc)
        if instruction is not None:
            if spec.score is not ScoreMethod.YES_NO:
                raise InvalidRequestError("instruction applies to a yes/no reranker (a Qwen3-Reranker) only")
            if not isinstance(instruction, str) or not instruction:
                raise InvalidRequestError(f"instruction={short_repr(instruction)} is invalid: give a non-empty string")
        return ScorePlan(query, list(docs), instruction)

    def score_ids(self, plan: ScorePlan) -> list[tuple[list[int], tuple[int, ...] | None]]:
        """Each (query, document) pair's token ids and token types (None: all 0), tokenized in one batch."""
        spec = self.runtime.pooler
        assert spec is not None and spec.score is not None, "an embed engine scores by embedding"
        tokenizer = self._tokenizer()
        if spec.score is ScoreMethod.YES_NO:
            instruction = plan.instruction or RERANKER_INSTRUCTION
            prefix, suffix = (
                tokenizer.encode(t, add_special_tokens=False).ids for t in (RERANKER_PREFIX, RERANKER_SUFFIX)
            )
            pairs = [f"<Instruct>: {instruction}\n<Query>: {plan.query}\n<Document>: {doc}" for doc in plan.documents]
            encoded = tokenizer.encode_batch(pairs, add_special_tokens=False)
            return [([*prefix, *e.ids, *suffix], None) for e in encoded]
        encoded = tokenizer.encode_batch([(plan.query, doc) for doc in plan.documents], add_special_tokens=True)
        return [(list(e.ids), tuple(e.type_ids)) for e in encoded]

    # ------------------------------------------------------------------ requests
    def request(
        self,
        request_id: str,
        ids: list[int],
        params: PoolingParams,
        arrival_time: float,
        *,
        priority: int = 0,
        deadline: float | None = None,
        where: str = "input",
    ) -> Request:
        """The pooling request for `ids` (checked: in the vocabulary, within the longest sequence)."""
        limit = self.runtime.max_seq_len
        if len(ids) > limit:
            raise InvalidRequestError(
                f"{where} has {len(ids)} tokens, more than this engine's limit of {limit} (max_model_len, or the "
                "KV cache if smaller): shorten it, or pass truncate_prompt_tokens to keep its last tokens"
            )
        try:
            ids = self.processor.tokenize(ids)  # ints within the vocabulary, not empty
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{where}: {exc}") from None
        types, spec = params.token_type_ids, self.runtime.pooler
        num_types = spec.type_vocab_size if spec is not None else None
        if types is not None and num_types is not None and max(types, default=0) >= num_types:
            # The token-type embedding has num_types rows: a larger id would index past it on the device.
            raise InvalidRequestError(
                f"{where}: its token_type_ids (from the tokenizer's pair encoding) go up to {max(types)}, but this "
                f"model's type_vocab_size is {num_types}: its tokenizer does not match the model"
            )
        return Request(
            request_id, ids, _DEFAULTS, arrival_time, 1, priority=priority, deadline=deadline, pooling=params
        )

    def score_params(self, type_ids: tuple[int, ...] | None) -> PoolingParams:
        return _SCORE_PARAMS if type_ids is None else PoolingParams(token_type_ids=type_ids)

    # ------------------------------------------------------------------ checks
    def _truncation(self, value: object) -> int | None:
        if value is None:
            return None
        limit = self.runtime.max_seq_len
        if not is_int(value) or not (value == -1 or 1 <= value <= limit):  # type: ignore[operator]
            raise InvalidRequestError(
                f"truncate_prompt_tokens={short_repr(value)} is invalid: give the tokens to keep (the last ones), "
                f"from 1 to {limit}, -1 for this engine's limit ({limit}), or None to refuse longer inputs"
            )
        return limit if value == -1 else value  # type: ignore[return-value]

    def _prefix(self, spec: PoolerSpec, prompt_name: object, items: list[str | list[int]]) -> str:
        """The text put before each text input: the named prompt, else the checkpoint's default one."""
        if prompt_name is None:
            return spec.prompts.get(spec.default_prompt_name, "") if spec.default_prompt_name else ""
        if not isinstance(prompt_name, str) or prompt_name not in spec.prompts:
            known = ", ".join(repr(n) for n in spec.prompts) or "none (no config_sentence_transformers.json prompts)"
            raise InvalidRequestError(
                f"prompt_name={short_repr(prompt_name)} is not one of this model's prompts: {known}"
            )
        if any(not isinstance(x, str) for x in items):
            raise InvalidRequestError(
                "prompt_name applies to text inputs: put the prompt's tokens in token-id inputs yourself"
            )
        return spec.prompts[prompt_name]

    def _check_text(self, where: str, text: str) -> None:
        try:
            self.processor.check_text(text, self._max_token_chars)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{where}: {exc}") from None

    def _special_prefix(self) -> int:
        """How many special tokens the tokenizer puts before a text (BERT: 1, its [CLS]; 0 without one)."""
        if self.tokenizer is None:
            return 0
        mask = backend_tokenizer(self.tokenizer).encode("a", add_special_tokens=True).special_tokens_mask
        return next((i for i, special in enumerate(mask) if not special), len(mask))

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: score() and rerank() take text")
        return backend_tokenizer(self.tokenizer)


def _as_inputs(inputs: object) -> list[str | list[int]]:
    """One input (a str, or a list of token ids) or a list of them, as a list; InvalidRequestError naming the
    first bad one."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(is_int(t) for t in inputs)):
        items: list[Any] = [inputs]
    elif isinstance(inputs, (list, tuple)):
        items = list(inputs)
    else:
        raise InvalidRequestError(
            f"inputs={short_repr(inputs)} is invalid: give a string, a list of token ids, or a list of those"
        )
    if not items:
        raise InvalidRequestError("inputs has 0 items: give at least one")
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            item = items[i] = list(item)
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"input {i} is empty: give a non-empty string or list of token ids")
        elif not isinstance(item, list) or not item or not all(is_int(t) for t in item):
            raise InvalidRequestError(
                f"input {i}={short_repr(item)} is invalid: give a non-empty string or a list of token ids"
            )
    return items


def _keep_last(ids: list[int], n: int, head: int) -> list[int]:
    """`ids` cut to `n` tokens: its first `head` (at most n), then its last ones."""
    if len(ids) <= n:
        return ids
    head = min(head, n)
    return ids[:head] + (ids[len(ids) - (n - head) :] if n > head else [])


def check_top_n(top_n: object) -> int | None:
    if top_n is not None and (not is_int(top_n) or top_n < 1):  # type: ignore[operator]
        raise InvalidRequestError(f"top_n={short_repr(top_n)} is invalid: give an integer >= 1, or None for all")
    return top_n  # type: ignore[return-value]


def rerank_results(scores: Sequence[float], documents: str | Sequence[str], top_n: int | None) -> list[RerankResult]:
    """The documents best first (ties in the order given), the first `top_n` (None: all)."""
    docs = [documents] if isinstance(documents, str) else list(documents)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [RerankResult(i, scores[i], docs[i]) for i in (order if top_n is None else order[:top_n])]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors (0.0 if either is all zeros)."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0
