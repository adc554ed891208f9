"""OpenAI's logprobs objects from the engine's per-token `{token id: logprob}` dicts.

Owns token strings (each id decoded on its own by the checkpoint's tokenizer, cached: a piece of a
multi-byte character reads as U+FFFD, as in other servers), their exact bytes where the tokenizer is
byte-level (so chat's `bytes` concatenate to the UTF-8 text, as OpenAI intends) and the two shapes: chat's
`content` list and completions' parallel lists. Knows nothing of HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncllm.outputs import TokenLogprobs

# JSON has no -Infinity (nor NaN): a token the model rules out entirely is reported at this floor instead.
_LOGPROB_FLOOR = -9999.0


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level alphabet: printable bytes stand for themselves, others for 256+i."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


class TokenStrings:
    """`strings(token_id) -> str`, decoded once per id; `strings.bytes(token_id)` its UTF-8 bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self._byte_decoder = _gpt2_byte_decoder() if byte_level else None

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes for byte-level tokenizers (a piece of a character included), else the
        UTF-8 encoding of its string."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = list(self(token_id).encode())
            if self._byte_decoder is not None:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(ch in self._byte_decoder for ch in piece):
                    raw = [self._byte_decoder[ch] for ch in piece]
            self._bytes[token_id] = raw
        return raw

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:  # a checkpoint without a tokenizer: ids are all there is
                text = f"<token {token_id}>"
            else:
                text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def clamp_logprob(value: float) -> float:
    """A logprob JSON can carry: at least the floor (NaN too)."""
    return value if value >= _LOGPROB_FLOOR else _LOGPROB_FLOOR  # NaN compares False: floored too


_lp = clamp_logprob


def _top(logprobs: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    # The dict holds the k most likely tokens plus the sampled one when it is not among them.
    return sorted(logprobs.items(), key=lambda item: -_lp(item[1]))[:k]


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], k: int, strings: TokenStrings
) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one streamed chunk)."""
    content = []
    for token_id, dist in zip(token_ids, logprobs):
        text = strings(token_id)
        content.append(
            {
                "token": text,
                "logprob": _lp(dist[token_id]),
                "bytes": strings.bytes(token_id),
                "top_logprobs": [
                    {"token": strings(t), "logprob": _lp(lp), "bytes": strings.bytes(t)} for t, lp in _top(dist, k)
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], k: int, strings: TokenStrings, offset: int
) -> dict[str, Any]:
    """`choices[].logprobs` of a completion; `offset` is where this text starts in the choice's text. A token
    without logprobs (an echoed prompt's first) has null for its logprob and its top logprobs, as in OpenAI's."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, dist in zip(token_ids, logprobs):
        text = strings(token_id)
        tokens.append(text)
        token_logprobs.append(_lp(dist[token_id]) if dist is not None else None)
        top.append(_top_by_string(dist, k, strings, token_id) if dist is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _top_by_string(logprobs: TokenLogprobs, k: int, strings: TokenStrings, chosen: int) -> dict[str, float]:
    """Completions key the top tokens by their strings: two that read alike (pieces of one character, U+FFFD)
    keep the likelier one's value. The chosen token is always there, beside the k most likely (OpenAI's and
    vLLM's shape: `logprobs=0` gives the chosen token alone, never `{}`)."""
    top: dict[str, float] = {}
    for token_id, lp in _top(logprobs, k):
        top.setdefault(strings(token_id), _lp(lp))
    top.setdefault(strings(chosen), _lp(logprobs[chosen]))
    return top


def join_logprobs(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two runs of a completion's logprobs as one (each list after the other)."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in first}
