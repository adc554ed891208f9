"""Jump-forward: the tokens a constraint forces next, so they can be output without a draw each.

xgrammar's matcher says which text certainly comes next (`find_jump_forward_string`: a JSON schema's keys
and punctuation under `any_whitespace=False`); `ForcedTokens` tokenises that text with the model's own
tokenizer (cached: the same few strings recur) and feeds the tokens to the matcher one by one, keeping the
longest prefix the matcher and the UTF-8 table accept. So the forced text is tokenised as the tokenizer
would, not chosen token by token. Knows nothing of slots, steps or requests: one matcher at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from asyncllm.structured_output.utf8 import BOUNDARY, Utf8Table

if TYPE_CHECKING:
    import xgrammar as xgr

# Distinct forced strings whose tokens are kept; the cache starts over when full (a schema forces a few dozen).
CACHE_ENTRIES = 4096


class ForcedTokens:
    """`run(matcher, state)`: the forced tokens the matcher has just accepted, and the UTF-8 state after them."""

    def __init__(self, tokenizer: Any, utf8: Utf8Table, is_stop: np.ndarray) -> None:
        self._tokenizer = tokenizer
        self._utf8 = utf8
        self._is_stop = is_stop  # [vocab] bool
        self._cache: dict[str, tuple[int, ...]] = {}

    def run(self, matcher: xgr.GrammarMatcher, state: int) -> tuple[list[int], int]:
        """Accept into `matcher` the tokens of the text it forces from here (none where it forces nothing or the
        output stands inside a character); (those tokens, the UTF-8 state after them)."""
        if state != BOUNDARY:
            return [], state
        text = matcher.find_jump_forward_string()
        if not text:
            return [], state
        tokens: list[int] = []
        nxt = self._utf8.next
        for token in self._encode(text):
            after = int(nxt[state, token])
            if after < 0 or not matcher.accept_token(token):
                break  # the text's last token may reach a character only what follows completes
            tokens.append(token)
            state = after
        return tokens, state

    def _encode(self, text: str) -> tuple[int, ...]:
        """`text`'s tokens, or none when they do not spell exactly `text` (a special token the decode skips,
        a normalising tokenizer) or include a stop token: a forced token must print what was forced."""
        tokens = self._cache.get(text)
        if tokens is None:
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            vocab = len(self._is_stop)
            spelled = self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            exact = spelled == text and all(0 <= t < vocab and not self._is_stop[t] for t in ids)
            tokens = tuple(ids) if exact else ()
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            self._cache[text] = tokens
        return tokens
