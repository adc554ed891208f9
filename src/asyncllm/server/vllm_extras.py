"""vLLM's extras around OpenAI's response shapes, for clients written against vLLM: the prompt's logprobs
(`prompt_logprobs`), token ids beside the text (`return_token_ids`) and prompt truncation
(`truncate_prompt_tokens`).

Owns their shapes as vLLM writes them and the truncation rule (the prompt's last k tokens: a chat keeps the
turn it answers). Knows nothing of HTTP beyond `OpenAIError`, nor of sampling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from asyncllm.outputs import TokenLogprobs
from asyncllm.server.errors import OpenAIError
from asyncllm.server.logprobs import TokenStrings, clamp_logprob


def check_truncation(keep: int | None) -> None:
    """`truncate_prompt_tokens`: k >= 1 keeps the prompt's last k tokens, -1 as many as fit."""
    if keep is not None and keep != -1 and keep < 1:
        raise OpenAIError(
            f"truncate_prompt_tokens={keep} is invalid: an integer >= 1 (the prompt's last k tokens are kept), "
            "or -1 (as many as fit the model)",
            param="truncate_prompt_tokens",
        )


def truncated(ids: Sequence[int], keep: int | None, max_len: int) -> list[int]:
    """The prompt's last `keep` tokens (-1: the last `max_len`); None keeps them all. A prompt truncated to
    the model's whole length leaves no room for output: the engine's length check then says so."""
    if keep is None:
        return list(ids)
    k = max_len if keep == -1 else keep
    return list(ids[-k:]) if len(ids) > k else list(ids)


async def truncated_prompts(
    prompts: Sequence[str | list[int]], keep: int | None, tokenizer: Any, max_len: int
) -> list[str | list[int]]:
    """Completion prompts cut to their last `keep` tokens: text prompts are tokenized here (off the loop),
    as the engine would (special tokens added), and sent as ids."""
    if keep is None:
        return list(prompts)
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise OpenAIError(
            "truncate_prompt_tokens needs a tokenizer for text prompts: send token ids", param="truncate_prompt_tokens"
        )

    def cut() -> list[str | list[int]]:
        ids = [list(tokenizer(p).input_ids) if isinstance(p, str) else p for p in prompts]
        return [truncated(p, keep, max_len) for p in ids]

    return await asyncio.to_thread(cut)


def prompt_logprobs_json(
    ids: Sequence[int], scored: Sequence[TokenLogprobs | None], k: int, strings: TokenStrings
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing precedes it), else {token id:
    {logprob, rank, decoded_token}} for the prompt's token and the `k` most likely (rank: 1 for the most
    likely; the prompt's token ranks among the k or is null, as its true rank is not computed here)."""
    out: list[dict[str, Any] | None] = []
    for token_id, dist in zip(ids, scored):
        if dist is None:
            out.append(None)
            continue
        ranked = sorted(dist.items(), key=lambda item: -clamp_logprob(item[1]))[:k]
        entry = {
            str(t): {"logprob": clamp_logprob(lp), "rank": rank, "decoded_token": strings(t)}
            for rank, (t, lp) in enumerate(ranked, start=1)
        }
        if str(token_id) not in entry:
            entry[str(token_id)] = {
                "logprob": clamp_logprob(dist[token_id]),
                "rank": None,
                "decoded_token": strings(token_id),
            }
        out.append(entry)
    return out
