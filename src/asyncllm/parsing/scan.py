"""Scanning text that arrives in pieces: how much of a buffer's end might be the start of a tag, and where
a JSON object or array that begins a stream closes. Knows no format; the parsers build on these two."""

from __future__ import annotations


def held_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (0 if none).

    Those characters are held back: the next piece decides whether they open the tag or are plain text.
    """
    # Candidates start where the tag's first character does, in the last len(tag) - 1 characters; the
    # earliest that fits is the longest. Mostly one `find` that finds nothing: this runs on every piece.
    start = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while start >= 0:
        if tag.startswith(text[start:]):
            return len(text) - start
        start = text.find(tag[0], start + 1)
    return 0


class JsonSpan:
    """Finds the end of one JSON object or array fed in pieces; the first character fed must open it.

    Tracks bracket depth outside strings (and escapes inside them); it does not validate, so `json.loads`
    still judges the span once it closes.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int | None:
        """Index in `text` just past the closing bracket, or None while the value is still open."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None
