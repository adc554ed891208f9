"""The completions endpoint's `echo`: each choice's text, and with `logprobs` its logprobs, start with its
prompt's.

Owns the prompt's text (a text prompt as sent, token ids decoded), the prompt's logprobs in the completions
shape (the first token's null: nothing precedes it), and `max_tokens=0`, the prompt alone: its engine request
draws one token (`max_tokens=1`, `openai_params`), which the response leaves out of the text, the logprobs
and the usage. The prompt's logprobs are the engine request's (`SamplingParams.prompt_logprobs`), on its
first chunk, shared by its n choices. Knows nothing of HTTP.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from asyncllm.outputs import OutputAccumulator, TokenLogprobs
from asyncllm.server.generation import MergedOutputs, Prompt, Submission
from asyncllm.server.logprobs import TokenStrings, completion_logprobs


class Echo:
    """One completion request's prompts, to put before its choices' text and logprobs."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        sub: Submission,
        top_k: int | None,
        strings: TokenStrings,
        tokenizer: Any,
        prompt_only: bool,
    ) -> None:
        self._prompts = prompts
        self._sub = sub
        self._top_k = top_k
        self._strings = strings
        self._tokenizer = tokenizer
        self.prompt_only = prompt_only  # max_tokens=0: the drawn token is left out (`without_completion`)
        self._scored: dict[int, Sequence[TokenLogprobs | None]] = {}  # engine request -> its prompt logprobs
        self._prefixes: dict[int, tuple[str, dict[str, Any] | None]] = {}  # engine request -> `prefix`, once whole

    def _request(self, choice: int) -> int:
        return bisect.bisect_right(self._sub.first_choice, choice) - 1

    def note(self, choice: int, prompt_logprobs: Sequence[TokenLogprobs | None] | None) -> None:
        """Keep the prompt logprobs that came with a chunk (or a result) of `choice`, for its request's choices."""
        if prompt_logprobs is not None:
            self._scored[self._request(choice)] = prompt_logprobs

    def prefix(self, choice: int) -> tuple[str, dict[str, Any] | None]:
        """The text and the logprobs (None unless asked for) that `choice` starts with: its prompt's."""
        k = self._request(choice)
        known = self._prefixes.get(k)
        if known is not None:  # the request's other choices
            return known
        prompt = self._prompts[k]
        ids = list(self._sub.streams[k].prompt_token_ids or ())
        if isinstance(prompt, str):
            text = prompt
        elif self._tokenizer is not None:
            text = self._tokenizer.decode(ids)
        else:  # a checkpoint without a tokenizer: the token strings are all there is
            text = "".join(self._strings(t) for t in ids)
        if self._top_k is None:
            self._prefixes[k] = (text, None)
            return text, None
        scored = self._scored.get(k)
        if scored is None:  # not yet known (they come with the request's first chunk)
            return text, None
        self._prefixes[k] = (text, completion_logprobs(ids, scored, self._top_k, self._strings, 0))
        return self._prefixes[k]

    def without_completion(self, result: OutputAccumulator) -> OutputAccumulator:
        """A choice's whole output without the drawn token (prompt only): its finish reason and metrics kept."""
        kept = OutputAccumulator()
        kept.add("", [], None, result.finish_reason, result.metrics, None, 0, result.prompt_logprobs)
        return kept


async def without_completions(outputs: MergedOutputs) -> MergedOutputs:
    """The chunks of prompt-only choices without their drawn token (usage then counts no completion tokens)."""
    try:
        async for index, out in outputs:
            yield index, replace(out, text="", token_ids=(), logprobs=None)
    finally:
        await outputs.aclose()
