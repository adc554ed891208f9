"""Turns a caller's (prompt, params) into a validated `Request`, or raises `InvalidRequestError`.

The front side's, shared by both fronts (`AsyncLLMEngine`, `LLM`), above the core: a bad request never
reaches the core and leaves no state behind. The cheap checks (`check_params`, `check_text`) run in the
caller's thread, tokenizing and the length checks (`make_request`) wherever the caller can afford them, and
so is compiling an output constraint (`check_constraint`, which may take a while on its first sight). The
tokenizer's `encode` and the constraint compiler's check (handed over by `build.py`) are the only
model-specific parts; knows no event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from asyncllm.core.request import Request
from asyncllm.errors import InvalidRequestError
from asyncllm.input_limits import check_unicode, text_char_limit
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import RuntimeInfo
from asyncllm.structured import StructuredOutput
from asyncllm.validation import is_int, short_repr

Encode = Callable[[str], list[int]]
EncodeBatch = Callable[[list[str]], list[list[int]]]
CheckConstraint = Callable[[StructuredOutput], None]  # raises InvalidRequestError unless it compiles


class InputProcessor:
    """`encode_batch`, when given, must equal `encode` text by text; it lets a tokenizer thread encode many
    texts in one call that releases the GIL (the Rust tokenizer's `encode_batch` does; its `encode` holds
    the GIL throughout, and the event loop waits)."""

    def __init__(
        self,
        runtime: RuntimeInfo,
        encode: Encode | None,
        encode_batch: EncodeBatch | None = None,
        check_constraint: CheckConstraint | None = None,
    ) -> None:
        self.runtime = runtime
        self._encode = encode
        self._encode_batch = encode_batch
        self._check_constraint = check_constraint

    @property
    def has_tokenizer(self) -> bool:
        return self._encode is not None

    # ------------------------------------------------------------------ cheap checks (no tokenizer run)
    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, not {type(params).__name__}")
        if params.stop_strings and self._encode is None:
            # Stop strings are matched on detokenized text; without a tokenizer they would be ignored silently.
            raise InvalidRequestError("stop strings need a tokenizer and this engine has none: use stop_token_ids")
        if params.structured is not None:
            self._check_constrainable(params, params.structured)
        return params

    def _check_constrainable(self, params: SamplingParams, spec: StructuredOutput) -> None:
        """What rules a constraint out before compiling it: a constrained output ends with EOS once complete."""
        name = f"SamplingParams.{spec.field}"
        if self._encode is None:
            raise InvalidRequestError(f"{name} needs the model's tokenizer (constraints compile over its vocabulary)")
        if not self.runtime.eos_token_ids or self._check_constraint is None:
            raise InvalidRequestError(f"{name} needs an EOS token to end a complete output, and this model has none")
        if params.ignore_eos:
            raise InvalidRequestError(f"{name} cannot be combined with ignore_eos: a complete output ends with EOS")
        if params.min_tokens:
            raise InvalidRequestError(
                f"{name} cannot be combined with min_tokens={params.min_tokens}: a constrained output ends with EOS "
                "as soon as it is complete, which may come first"
            )

    def check_constraint(self, params: SamplingParams) -> None:
        """Compile the output constraint of params that passed `check_params` (cached by its text): raises
        `InvalidRequestError` naming the field when it does not compile. The first sight of a constraint can
        take long (a large schema, a large vocabulary): never call it on an event loop."""
        if params.structured is not None:
            assert self._check_constraint is not None, "check_params refuses constraints without a compiler"
            self._check_constraint(params.structured)

    def check_text(self, text: str, max_token_chars: int | None = None) -> None:
        """What can be said of a text prompt without tokenizing it, in time linear in its length at C speed.

        `max_token_chars` (the most characters one token of the vocabulary spells) bounds how many
        characters could fit the longest sequence: a longer text is refused before the tokenizer spends
        seconds on it. (A tokenizer whose normalizer drops characters could fit more; such texts are
        refused too, with this message.)
        """
        if text == "":
            raise InvalidRequestError("prompt is empty: give a non-empty string or list of token ids")
        if self._encode is None:
            raise InvalidRequestError("this engine has no tokenizer: give the prompt as token ids")
        max_chars = text_char_limit(self.runtime.max_seq_len, max_token_chars)
        if max_chars is not None and max_token_chars is not None:
            limit = self.runtime.max_seq_len
            if len(text) > max_chars:
                raise InvalidRequestError(
                    f"prompt has {len(text):,} characters, more than any {limit} tokens (the longest sequence "
                    f"this engine holds) can spell: at most {max_chars:,} characters here "
                    f"({max_token_chars} per token at most in this vocabulary); shorten the prompt"
                )
        check_unicode("prompt", text)  # a lone surrogate: the tokenizer would raise its own TypeError

    # ------------------------------------------------------------------ the whole check
    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of texts that passed `check_text`, in one batch call when the tokenizer has one."""
        if self._encode_batch is not None:
            return self._encode_batch(texts)
        assert self._encode is not None
        return [self._encode(text) for text in texts]

    def tokenize(self, prompt: Any, encoded: list[int] | None = None) -> list[int]:
        """The prompt's ids, checked; `encoded`: a text prompt's ids from `encode_texts`."""
        if isinstance(prompt, str):
            if encoded is None:
                self.check_text(prompt)
                assert self._encode is not None
                encoded = self._encode(prompt)
            ids = encoded
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            # Types and range at C speed (map, set, min, max): a long prompt must not hold the caller's loop.
            if not all(issubclass(t, int) and t is not bool for t in set(map(type, ids))):
                raise InvalidRequestError("prompt token ids must all be integers")
        else:
            raise InvalidRequestError(f"prompt must be a str or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt is empty (no tokens): give at least one token")
        vocab = self.runtime.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def make_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None,
        arrival_time: float,
        encoded: list[int] | None = None,
        priority: int = 0,
        lora: str | None = None,
        deadline: float | None = None,
    ) -> Request:
        """The checked `Request`; `encoded`: a text prompt's ids from `encode_texts`, to skip encoding it;
        `priority` and `lora` checked already (`check_priority`, `check_lora`); `deadline` on the engine's
        clock (`arrival_time` plus a checked timeout)."""
        params = self.check_params(params)
        if isinstance(prompt, (list, tuple)):
            self._check_length(len(prompt), params)  # before looking at a single id: cost bounded by the limit
        ids = self.tokenize(prompt, encoded)
        self._check_length(len(ids), params)
        room = self.runtime.max_seq_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"SamplingParams.max_tokens={params.max_tokens} does not fit: the prompt has {len(ids)} tokens "
                f"and {self._limit_name()} leaves room for {room}; lower max_tokens to at most {room}, or leave "
                "it None to generate up to the limit"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        eos = frozenset() if params.ignore_eos else self.runtime.eos_token_ids
        return Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            arrival_time=arrival_time,
            max_tokens=max_tokens,
            eos_token_ids=eos,
            priority=priority,
            lora_name=lora,
            deadline=deadline,
        )

    def check_lora(self, lora: object, known: Collection[str] | None = None) -> str | None:
        """A request's LoRA adapter name (None: the base model); refused when the engine serves no adapters
        or, given the names `known` to be added, when it is not one of them."""
        if lora is None:
            return None
        if not isinstance(lora, str) or not lora:
            raise InvalidRequestError(f"lora={short_repr(lora)} is invalid: give an added adapter's name, or None")
        if not self.runtime.max_loras:
            raise InvalidRequestError(f"lora={lora!r}: this engine was built without enable_lora=True")
        if known is not None and lora not in known:
            added = ", ".join(repr(n) for n in known) or "none"
            raise InvalidRequestError(f"lora={lora!r} is not an added LoRA adapter (added: {added}); add_lora it first")
        return lora

    @staticmethod
    def check_timeout(timeout: object) -> float | None:
        """A request's timeout in seconds (None: none): a finite number > 0."""
        if timeout is None:
            return None
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise InvalidRequestError(
                f"timeout={short_repr(timeout)} is invalid: give seconds > 0 (a finite number), or None for no deadline"
            )
        return float(timeout)

    @staticmethod
    def check_priority(priority: object) -> int:
        """A request's priority: any integer, lower runs first."""
        if not is_int(priority):
            raise InvalidRequestError(
                f"priority={short_repr(priority)} is invalid: give an integer (lower runs first; default 0)"
            )
        return priority  # type: ignore[return-value]

    def _limit_name(self) -> str:
        """The limit that binds a sequence's length: a small KV cache caps sequences below max_model_len."""
        rt = self.runtime
        if rt.max_seq_len == rt.max_model_len:
            return f"max_model_len ({rt.max_model_len})"
        return f"the KV cache capacity ({rt.max_seq_len} tokens; max_model_len is {rt.max_model_len})"

    def _check_length(self, n: int, params: SamplingParams) -> None:
        rt = self.runtime
        if n > rt.kv_capacity_tokens:
            raise InvalidRequestError(
                f"prompt has {n} tokens, more than the whole KV cache holds "
                f"({rt.kv_capacity_tokens} tokens = "
                f"{rt.num_kv_blocks} blocks x {rt.block_size}); raise num_kv_blocks or shorten the prompt"
            )
        if n + max(1, params.min_tokens) > rt.max_seq_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + min_tokens ({params.min_tokens}, at least 1 token to generate) "
                f"exceeds {self._limit_name()}; shorten the prompt or lower min_tokens"
            )
