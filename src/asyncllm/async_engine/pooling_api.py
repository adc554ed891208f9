"""`embed`, `score` and `rerank`: the calls of an embed or score engine, part of `AsyncLLMEngine`.

Each input of a call is one pooling request, through the same admission as a generation request (each counts
against `max_waiting_requests`, refused with `EngineOverloadedError`; `priority`; `timeout`) and out through
its own output slot, whose final delta brings its vector (`OutputSlot.pooled`). The call's cheap checks raise
in the caller; its texts are tokenized in a worker thread (one batch call), never on the loop; then every
request is checked before any is queued, so a bad input leaves nothing behind. Leaving the call early in any
way (cancellation, an error of one input) aborts every request of it still live. Knows no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from asyncllm.async_engine.admission import Admission
from asyncllm.async_engine.ids import LiveRequests, new_request_id
from asyncllm.async_engine.loop_fanout import LoopFanout
from asyncllm.async_engine.loops import current_loop_key, run_in_thread
from asyncllm.async_engine.mailbox import OutputSlot, new_slot
from asyncllm.async_engine.pooling_inputs import PoolingInputs, check_top_n, cosine, rerank_results
from asyncllm.async_engine.stream import RequestStream
from asyncllm.config_values import Task
from asyncllm.input_processor import InputProcessor
from asyncllm.pooling import EmbeddingOutput, PoolingParams, RerankResult

T = TypeVar("T")
Prompt = str | list[int]


class PoolingAPI:
    """The embed/score/rerank half of `AsyncLLMEngine` (see docs/embeddings.md)."""

    _pooling: PoolingInputs
    _input_processor: InputProcessor
    _live: LiveRequests[OutputSlot]
    _fanout: LoopFanout
    _admission: Admission
    _clock: Callable[[], float]
    _max_token_chars: int | None

    def _start_pooling(self, tokenizer: object) -> None:
        """Once the core is up: the checks and tokenizing of pooling calls (generation calls ask them too)."""
        self._pooling = PoolingInputs(self._input_processor, tokenizer, self._max_token_chars)

    async def embed(
        self,
        inputs: Prompt | Sequence[Prompt],
        *,
        dimensions: int | None = None,
        normalize: bool = True,
        prompt_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> list[EmbeddingOutput]:
        """One `EmbeddingOutput` per input (a str, a list of token ids, or a list of those), in order.

        `dimensions`: keep the first n values (Matryoshka), renormalised when `normalize`. `normalize`: unit
        vectors (a checkpoint whose modules.json ends with Normalize gives unit vectors anyway, as
        sentence-transformers does). `prompt_name`: a prompt of the checkpoint's
        config_sentence_transformers.json put before every text (Qwen3-Embedding's "query"; None: its
        `default_prompt_name`'s, usually none). `truncate_prompt_tokens`: keep each input's last n tokens
        (-1: the engine's limit); None refuses a longer input with `InvalidRequestError` naming the limit.
        `priority` and `timeout` as in `add_request`. Raises `InvalidRequestError` on an engine that does
        not embed (task="embed")."""
        arrival = self._clock()
        pooling = self._pooling
        plan = pooling.embed_plan(inputs, dimensions, normalize, prompt_name, truncate_prompt_tokens)
        priority, deadline = self._call_limits(priority, timeout, arrival)
        ids = await _off_loop(lambda: pooling.embed_ids(plan))
        vectors = await self._run_pooled([(x, plan.params) for x in ids], arrival, priority, deadline)
        return [EmbeddingOutput(v, len(x)) for v, x in zip(vectors, ids)]

    async def score(
        self,
        query: str,
        documents: str | Sequence[str],
        *,
        instruction: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> list[float]:
        """How relevant each document is to `query`, in the documents' order: a cross-encoder's sigmoid, a
        yes/no reranker's P("yes") (`instruction`: its task line; None: its model card's default), or on an
        embed engine the cosine similarity of the two embeddings."""
        scores, _ = await self._scored(query, documents, instruction, priority, timeout)
        return scores

    async def _scored(
        self, query: object, documents: object, instruction: object, priority: object, timeout: object
    ) -> tuple[list[float], int]:
        """`score`'s scores, and the tokens the engine read for them (a server's usage)."""
        arrival = self._clock()
        pooling = self._pooling
        plan = pooling.score_plan(query, documents, instruction)
        checked, deadline = self._call_limits(priority, timeout, arrival)
        if self._pooling.runtime.task is Task.EMBED:
            embed = pooling.embed_plan([plan.query, *plan.documents])
            ids = await _off_loop(lambda: pooling.embed_ids(embed))
            vectors = await self._run_pooled([(x, embed.params) for x in ids], arrival, checked, deadline)
            return [cosine(vectors[0], v) for v in vectors[1:]], sum(map(len, ids))
        pairs = await _off_loop(lambda: pooling.score_ids(plan))
        inputs = [(ids, pooling.score_params(types)) for ids, types in pairs]
        scores = [v[0] for v in await self._run_pooled(inputs, arrival, checked, deadline)]
        return scores, sum(len(ids) for ids, _ in pairs)

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        instruction: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> list[RerankResult]:
        """The documents best first, as `RerankResult`s (`index`, `relevance_score`, `document`); the first
        `top_n` (None: all). Scores as `score` computes them."""
        top_n = check_top_n(top_n)
        scores = await self.score(query, documents, instruction=instruction, priority=priority, timeout=timeout)
        return rerank_results(scores, documents, top_n)

    def _call_limits(self, priority: object, timeout: object, arrival: float) -> tuple[int, float | None]:
        ip = self._input_processor
        seconds = ip.check_timeout(timeout)
        return ip.check_priority(priority), None if seconds is None else arrival + seconds

    async def _run_pooled(
        self, inputs: list[tuple[list[int], PoolingParams]], arrival: float, priority: int, deadline: float | None
    ) -> list[list[float]]:
        """Each input's vector, its requests checked first, then queued in order, then awaited."""
        library, loop_key = current_loop_key()
        dead = self._live.closed_error()
        if dead is not None:
            raise dead
        requests = [
            self._pooling.request(
                new_request_id(), ids, params, arrival, priority=priority, deadline=deadline, where=f"input {i}"
            )
            for i, (ids, params) in enumerate(inputs)
        ]
        opened: list[tuple[OutputSlot, RequestStream]] = []
        try:
            for request in requests:  # registered and queued at once: a refusal leaves nothing half-made
                mailbox = self._fanout.attach(library, loop_key)
                slot = new_slot(request.request_id, mailbox, 1)
                try:
                    self._live.register(request.request_id, slot)
                except BaseException:
                    self._fanout.detach(mailbox)
                    raise
                opened.append((slot, RequestStream(slot, self._admission.abort)))
                self._admission.submit(slot, request)
            vectors = []
            for slot, stream in opened:
                async for _ in stream:  # its one chunk ends it; an error (a timeout, say) raises here
                    pass
                assert slot.pooled is not None, "a pooling request's final delta carries its vector"
                vectors.append(slot.pooled)
            return vectors
        finally:
            for _, stream in opened:  # a no-op for those finished; aborts the rest
                stream.close()


async def scores_and_tokens(
    engine: PoolingAPI,
    query: object,
    documents: object,
    *,
    instruction: object = None,
    priority: object = 0,
    timeout: object = None,
) -> tuple[list[float], int]:
    """`engine.score`'s scores and the number of tokens they read: the server's /v1/score and /v1/rerank
    answer with both (their `usage`)."""
    return await engine._scored(query, documents, instruction, priority, timeout)  # the class is this module's


async def _off_loop(fn: Callable[[], T]) -> T:
    """`fn()` in a worker thread (tokenizing: never on the caller's loop)."""
    result: list[T] = []
    await run_in_thread(lambda: result.append(fn()))
    return result[0]
