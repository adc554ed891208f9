"""`StructuredOutput`: the one normalised form of a request's output constraint (a JSON schema, any JSON
object, a regular expression, a choice of strings, or an EBNF grammar).

`SamplingParams` builds it from whichever of its five fields was set, checking types only; whether the
constraint compiles is decided where the grammar engine lives (the input processor asks it when the request
is made). Plain data, hashable: compiled grammars are cached by it. Plain Python; no torch.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

# Bounds the text a request may hand to the grammar compiler (and the bytes each request sends to workers).
MAX_CONSTRAINT_CHARS = 200_000


class StructuredKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: the schema as JSON
    JSON_OBJECT = "json_object"  # text: "" (any JSON object)
    REGEX = "regex"  # text: the pattern
    CHOICE = "choice"  # text: the choices as a JSON list of strings
    GRAMMAR = "grammar"  # text: EBNF (GBNF) with a `root` rule


@dataclass(frozen=True)
class StructuredOutput:
    kind: StructuredKind
    text: str

    @property
    def field(self) -> str:
        """The `SamplingParams` field it came from, for error messages."""
        return self.kind.value

    @property
    def choices(self) -> list[str]:
        assert self.kind is StructuredKind.CHOICE
        values: list[str] = json.loads(self.text)
        return values
