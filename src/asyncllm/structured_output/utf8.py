"""`Utf8Table`: which tokens keep a constrained output valid UTF-8, by where its bytes stand within a character.

xgrammar (0.2.9) checks characters, not their encodings: where a grammar allows any character (a JSON
string, `.`, a negated class) it also lets through UTF-8 encoded UTF-16 surrogates and some overlong forms,
which are not valid UTF-8, and the output text shows U+FFFD for them (a random-weight model emits them
readily; a trained one hardly ever). So a constrained row's grammar mask is also ANDed with the mask of this
table's state: the state of the output's last, possibly incomplete, character (one of eight, the standard
UTF-8 automaton), advanced by each accepted token's bytes. A stop token is allowed only between characters.
Knows nothing of grammars, requests or devices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

BOUNDARY = 0  # between characters: the state every output starts in
_NUM_STATES = 8
# The other states, by what the next byte must be: (low, high, state after it).
_CONTINUATIONS = {
    1: (0x80, 0xBF, BOUNDARY),  # the last continuation byte
    2: (0x80, 0xBF, 1),  # two left
    3: (0xA0, 0xBF, 1),  # after E0: no overlong three-byte form
    4: (0x80, 0x9F, 1),  # after ED: no surrogate
    5: (0x80, 0xBF, 2),  # three left
    6: (0x90, 0xBF, 2),  # after F0: no overlong four-byte form
    7: (0x80, 0x8F, 2),  # after F4: nothing past U+10FFFF
}


def _lead(byte: int) -> int:
    """The state after `byte` at a character boundary (-1: not a valid first byte)."""
    if byte < 0x80:
        return BOUNDARY
    if 0xC2 <= byte <= 0xDF:
        return 1
    if byte == 0xE0:
        return 3
    if byte == 0xED:
        return 4
    if 0xE1 <= byte <= 0xEF:
        return 2
    if byte == 0xF0:
        return 6
    if 0xF1 <= byte <= 0xF3:
        return 5
    if byte == 0xF4:
        return 7
    return -1


def _walk(state: int, piece: bytes) -> int:
    for byte in piece:
        if state == BOUNDARY:
            state = _lead(byte)
            if state < 0:
                return -1
        else:
            low, high, after = _CONTINUATIONS[state]
            if not low <= byte <= high:
                return -1
            state = after
    return state


def _whole(piece: bytes) -> bool:
    """Whole characters, valid UTF-8 (most of a vocabulary: checked at C speed)."""
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return True


class Utf8Table:
    """`next[state, token]`: the state after the token's bytes (-1: invalid); `allowed[state]`: those tokens as
    a bitmask row (xgrammar's int32 layout)."""

    def __init__(self, pieces: Sequence[bytes], stop_token_ids: Collection[int], words: int) -> None:
        vocab = len(pieces)
        table = np.full((_NUM_STATES, vocab), -1, dtype=np.int8)
        for token, piece in enumerate(pieces):
            if not piece:  # adds no bytes (a special token the grammar masks anyway)
                table[:, token] = np.arange(_NUM_STATES)
                continue
            if piece[0] < 0x80 or 0xC2 <= piece[0] <= 0xF4:  # starts a character: valid only at a boundary
                table[BOUNDARY, token] = BOUNDARY if _whole(piece) else _walk(BOUNDARY, piece)
                continue
            for state in range(1, _NUM_STATES):  # a continuation byte first: the tail of a character
                table[state, token] = _walk(state, piece)
        for token in stop_token_ids:
            if token < vocab:
                table[:, token] = -1
                table[BOUNDARY, token] = BOUNDARY  # the output may end only after a whole character
        self.next = table
        bits = np.zeros((_NUM_STATES, words * 32), dtype=bool)
        bits[:, :vocab] = table >= 0
        self.allowed = np.packbits(bits, axis=1, bitorder="little").view("<i4")  # [states, words] int32

    @classmethod
    def from_arrays(cls, next_state: np.ndarray, allowed: np.ndarray) -> Utf8Table:
        """The table another one's `next` and `allowed` describe (sent to the grammar process)."""
        table = cls.__new__(cls)
        table.next, table.allowed = next_state, allowed
        return table

    def advance(self, state: int, token_id: int) -> int:
        """The state after `token_id` (which `allowed[state]` allowed)."""
        return int(self.next[state, token_id])
