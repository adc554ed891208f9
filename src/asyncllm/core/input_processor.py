"""Turns a caller's (prompt, params) into a validated `Request`, or raises `InvalidRequestError`.

Runs in the caller's thread before anything is queued, so a bad request never reaches the step thread and
leaves no state behind. The tokenizer's `encode` is the only model-specific part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncllm.core.request import Request
from asyncllm.errors import InvalidRequestError
from asyncllm.executor.interface import RuntimeInfo
from asyncllm.sampling_params import SamplingParams

Encode = Callable[[str], list[int]]


class InputProcessor:
    def __init__(self, runtime: RuntimeInfo, encode: Encode | None) -> None:
        self.runtime = runtime
        self._encode = encode

    def tokenize(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt is empty: give a non-empty string or list of token ids")
            if self._encode is None:
                raise InvalidRequestError("this engine has no tokenizer: give the prompt as token ids")
            ids = self._encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise InvalidRequestError("prompt token ids must all be integers")
        else:
            raise InvalidRequestError(f"prompt must be a str or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt is empty (no tokens): give at least one token")
        vocab = self.runtime.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def make_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None,
        arrival_time: float,
    ) -> Request:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, not {type(params).__name__}")
        if params.stop_strings and self._encode is None:
            # Stop strings are matched on detokenized text; without a tokenizer they would be ignored silently.
            raise InvalidRequestError("stop strings need a tokenizer and this engine has none: use stop_token_ids")
        ids = self.tokenize(prompt)
        rt = self.runtime
        n = len(ids)
        if n > rt.kv_capacity_tokens:
            raise InvalidRequestError(
                f"prompt has {n} tokens, more than the whole KV cache holds "
                f"({rt.kv_capacity_tokens} tokens = "
                f"{rt.num_kv_blocks} blocks x {rt.block_size}); raise num_kv_blocks or shorten the prompt"
            )
        limit = rt.max_seq_len
        if n + max(1, params.min_tokens) > limit:
            # Name the limit that binds: a small KV cache caps sequences below max_model_len.
            which = (
                f"max_model_len ({limit})"
                if limit == rt.max_model_len
                else f"the KV cache capacity ({limit} tokens; max_model_len is {rt.max_model_len})"
            )
            raise InvalidRequestError(
                f"prompt ({n} tokens) + min_tokens ({params.min_tokens}, at least 1 token to generate) "
                f"exceeds {which}; shorten the prompt or lower min_tokens"
            )
        room = limit - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = frozenset() if params.ignore_eos else self.runtime.eos_token_ids
        return Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            arrival_time=arrival_time,
            max_tokens=max_tokens,
            eos_token_ids=eos,
        )
