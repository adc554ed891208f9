"""`LLM`: offline batch generation on the same engine core as the async engine, in the caller's thread.

It drives the core itself (no client, no step thread) and shares the async engine's front-side pieces:
the request checks (`input_processor`) and the output accumulator (`outputs.OutputAccumulator`).
"""

from __future__ import annotations

import atexit
import gc
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

from asyncllm.async_engine.admission import max_token_chars_of
from asyncllm.async_engine.pooling_inputs import PoolingInputs, check_top_n, cosine, rerank_results
from asyncllm.config import EngineConfig
from asyncllm.config_values import Task
from asyncllm.errors import InvalidRequestError, LoRAError, RequestFailedError
from asyncllm.input_processor import InputProcessor
from asyncllm.outputs import RequestOutput, new_accumulator, request_error
from asyncllm.pooling import EmbeddingOutput, PoolingParams, RerankResult
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import RuntimeInfo

Prompt = str | list[int]


class LLM:
    """`LLM(model, **engine_args).generate(prompts, params)`: results in prompt order."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        from asyncllm.build import build_engine  # the runner (torch) loads only now

        self.config = EngineConfig.from_kwargs(model, **engine_args).resolved(streaming=False)
        self._engine = build_engine(self.config, time.monotonic)
        engine = self._engine
        self._inputs = InputProcessor(engine.runtime, engine.encode, engine.encode_batch, engine.check_constraint)
        self._ids = itertools.count()
        self._pooling = PoolingInputs(self._inputs, engine.tokenizer, max_token_chars_of(engine.tokenizer))
        # What loading left (model, tokenizer, libraries) lives as long as the process: out of the garbage
        # collector's reach, a full collection no longer walks it (see AsyncLLMEngine).
        gc.collect()
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # at exit it must be collectable again, or extensions report leaks
        atexit.register(gc.unfreeze)

    @property
    def tokenizer(self) -> Any | None:
        return self._engine.tokenizer

    @property
    def runtime(self) -> RuntimeInfo:
        """Facts learned at load: vocabulary size, KV blocks, EOS ids, device, dtype, attention backend."""
        return self._engine.runtime

    def stats(self) -> dict[str, float | int]:
        return self._engine.core.stats().as_dict()

    def add_lora(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT LoRA adapter in `path` and serve it as `name` (`generate(..., lora=name)`); raises
        `LoRAError` as `AsyncLLMEngine.add_lora` does (docs/lora.md)."""
        if not isinstance(name, str) or not name.strip():
            raise LoRAError(f"name={name!r} is invalid: give the LoRA adapter a non-empty name")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise LoRAError(f"path={path!r} is invalid: give the adapter's directory")
        self._engine.core.add_lora(name, os.fspath(path))

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name` (`LoRAError` for an unknown name)."""
        self._engine.core.remove_lora(name)

    def list_loras(self) -> list[str]:
        """The adapters added, in the order they were."""
        return self._engine.core.lora_names()

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The conversation as prompt token ids through the model's chat template (ids, not text: encoding the
        text again would add a second BOS for templates that write their own)."""
        from asyncllm.chat import apply_chat_template

        return apply_chat_template(
            self._engine.tokenizer, messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in prompt order. `priority`: one per prompt (lower runs first; the
        default 0 each): which prompts the engine starts first when they do not all fit at once. `lora`: an
        added adapter's name for every prompt, or one name (or None: the base model) per prompt."""
        self._pooling.check_generates("generate()")
        prompt_list = self._as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(prompt_list)} prompts but {len(param_list)} SamplingParams; give one or one each"
                )
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise InvalidRequestError(f"got {len(prompt_list)} prompts but {len(priorities)} priorities; give one each")
        loras = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompt_list):
            raise InvalidRequestError(
                f"got {len(prompt_list)} prompts but {len(loras)} lora names; give one or one each"
            )
        # Validate everything before queuing anything, so one bad prompt leaves the engine untouched.
        now = time.monotonic()
        known = self._engine.core.lora_names() if any(loras) else []
        ip = self._inputs
        requests = [
            ip.make_request(
                f"llm-{next(self._ids)}", p, sp, now, priority=ip.check_priority(pr), lora=ip.check_lora(name, known)
            )
            for p, sp, pr, name in zip(prompt_list, param_list, priorities, loras)
        ]
        for request in requests:
            self._inputs.check_constraint(request.params)  # compiles each output constraint (cached by its text)
        core = self._engine.core
        outputs = {r.request_id: new_accumulator(r.params.n) for r in requests}
        num_finished = 0
        bar = _progress(len(requests)) if use_tqdm else None
        try:
            for request in requests:
                core.add_request(request)
            while num_finished < len(requests):
                t0 = time.perf_counter()
                deltas = core.step()
                if bar is not None:
                    bar.update_step(core.last_step, time.perf_counter() - t0)
                for d in deltas:
                    output = outputs[d.request_id]
                    output.add(
                        d.new_text,
                        d.new_token_ids,
                        d.logprobs,
                        d.finish_reason,
                        d.metrics,
                        d.error,
                        d.index,
                        d.prompt_logprobs,
                    )
                    if d.finish_reason is not None and not d.open_samples:  # the request's last sample ended
                        num_finished += 1
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request in requests:  # never leave half a batch in the engine
                core.abort_request(request.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [outputs[r.request_id].result(r.request_id, list(r.prompt_token_ids)) for r in requests]

    # ------------------------------------------------------------------ embed, score, rerank (docs/embeddings.md)
    def embed(
        self,
        inputs: Prompt | Sequence[Prompt],
        *,
        dimensions: int | None = None,
        normalize: bool = True,
        prompt_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingOutput]:
        """One `EmbeddingOutput` per input, in order; the options as `AsyncLLMEngine.embed`'s."""
        pooling = self._pooling
        plan = pooling.embed_plan(inputs, dimensions, normalize, prompt_name, truncate_prompt_tokens)
        ids = pooling.embed_ids(plan)
        return [EmbeddingOutput(v, len(x)) for v, x in zip(self._run_pooled([(x, plan.params) for x in ids]), ids)]

    def score(self, query: str, documents: str | Sequence[str], *, instruction: str | None = None) -> list[float]:
        """Each document's relevance to `query`, in order, as `AsyncLLMEngine.score` computes it."""
        pooling = self._pooling
        plan = pooling.score_plan(query, documents, instruction)
        if self.runtime.task is Task.EMBED:  # cosine similarity of the embeddings
            vectors = [e.embedding for e in self.embed([plan.query, *plan.documents])]
            return [cosine(vectors[0], v) for v in vectors[1:]]
        return [v[0] for v in self._run_pooled([(x, pooling.score_params(t)) for x, t in pooling.score_ids(plan)])]

    def rerank(
        self, query: str, documents: Sequence[str], *, top_n: int | None = None, instruction: str | None = None
    ) -> list[RerankResult]:
        """The documents best first, the first `top_n` (None: all), as `AsyncLLMEngine.rerank`'s."""
        top_n = check_top_n(top_n)
        return rerank_results(self.score(query, documents, instruction=instruction), documents, top_n)

    def _run_pooled(self, inputs: list[tuple[list[int], PoolingParams]]) -> list[list[float]]:
        """Each input's vector: every request checked, then all run; an error aborts the rest."""
        now = time.monotonic()
        requests = [
            self._pooling.request(f"llm-{next(self._ids)}", ids, params, now, where=f"input {i}")
            for i, (ids, params) in enumerate(inputs)
        ]
        core = self._engine.core
        vectors: dict[str, list[float]] = {}
        try:
            for request in requests:
                core.add_request(request)
            while len(vectors) < len(requests):
                for d in core.step():
                    if d.error is not None:
                        raise request_error(d.error)
                    if d.pooled is None and d.finish_reason is not None:
                        raise RequestFailedError(
                            f"pooling request {d.request_id!r} ended ({d.finish_reason}) without a vector"
                        )
                    if d.pooled is not None:
                        vectors[d.request_id] = d.pooled
        except BaseException:
            for request in requests:  # never leave half a batch in the engine
                core.abort_request(request.request_id)
            raise
        return [vectors[r.request_id] for r in requests]

    def shutdown(self) -> None:
        self._engine.core.shutdown()

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # a single prompt given as token ids
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(
                f"prompts must be a str, a list of token ids, or a list of those, not {type(prompts).__name__}"
            )
        return list(prompts)


class _progress:
    """A tqdm bar over finished requests, showing prefill and decode tokens per second, each over the time of
    the steps that carried such tokens (a step carrying both counts for both). Over the whole run instead, the
    prefill rate fell towards 0 during the decode steps that follow the prompts (regression: "prefill 1 tok/s")."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]

        self._bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
        self._prefill = self._decode = 0
        self._prefill_s = self._decode_s = 0.0

    def update_step(self, counts: Any, seconds: float) -> None:
        if counts.num_prefill_tokens:
            self._prefill += counts.num_prefill_tokens
            self._prefill_s += seconds
        if counts.num_decode_tokens:
            self._decode += counts.num_decode_tokens
            self._decode_s += seconds
        rates = [
            f"{name} {tokens / elapsed:,.0f} tok/s"
            for name, tokens, elapsed in (
                ("prefill", self._prefill, self._prefill_s),
                ("decode", self._decode, self._decode_s),
            )
            if elapsed > 0
        ]
        if rates:
            self._bar.set_postfix_str(", ".join(rates), refresh=False)

    def update(self, n: int) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()
