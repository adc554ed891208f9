"""The grammar process's messages, both ways, as bytes over its two pipes (`grammar_process.py` writes requests
and reads replies; `grammar_worker.py` the reverse). The bitmask rows themselves never travel: the worker
writes them into the shared `RowsSegment`. Knows nothing of matchers or steps beyond these fields.

Requests, in order: each carries the adds and removes since the last one (`ops`), then its rows.
  STEP  (set, verdict, seq; rows, slots, tokens; leads): slots[i] accepts leads[i] (a verified step's accepted
        tokens before its last; sent as each slot's count, then the tokens), then tokens[i], then row rows[i]
        of the set is filled for slots[i]; with `verdict` an ACCEPTED reply comes as soon as every token is
        accepted.
  DRAFTS (set, seq; rows, slots, tokens): a drafting slot's rows in a run, each with its slot and its draft:
        the slot's matcher accepts each draft, its row filled after it, then rolls back (`draft_fill.py`).
  FILL  (set, seq; rows, slots): rows[i] filled for slots[i] (a request the last STEP did not cover).
  OPS   the ops alone, no reply: the last request went (its matcher is freed now, not at the next step), or
        a constraint's compile started in the engine's process (the worker compiles it at the same time).
  MARK  (set, seq, mark): no rows, only the mark (below); replied to as a FILL with no rows is.
Any request may carry a `mark`: once its rows are written, the worker stores it in the set's flag (the
layout's flags page), which the device waits on before it reads the set (`stream_wait.py`); every request
before it is done by then.
Replies: ACCEPTED (seq, refusals by slot), FILLED (seq, errors by slot of the slots it filled: to STEP, FILL,
DRAFTS and MARK), SLOW (seq, the slots whose rows turned slow in that message's work, each with ""; before its
FILLED: fill_costs.py), READY once at start-up, FAILED (a traceback) before the worker exits on an error of
its own.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.structured import StructuredOutput

STEP, FILL, OPS, MARK, DRAFTS = 1, 2, 3, 4, 5  # requests
ACCEPTED, FILLED, READY, FAILED, SLOW = 1, 2, 3, 4, 5  # replies

_REQUEST = struct.Struct("<BBBxIIIII")  # kind, set, verdict, seq, rows, ops bytes, mark, lead tokens
_REPLY = struct.Struct("<BxxxII")  # kind, seq, payload bytes

# ("add", slot, spec), ("remove", slot) or ("compile", 0, spec): compile it now, for requests to come
Op = tuple[str, int] | tuple[str, int, StructuredOutput]


@dataclass(frozen=True)
class Init:
    """The worker's start-up message: what `GrammarBackend.from_tables` needs, the rows' layout, and how
    many threads may fill rows at once."""

    tables: Any  # structured_output.backend.VocabularyTables
    layout: Any  # structured_output.host_rows.RowsLayout
    threads: int
    slow_fill_s: float | None = None  # the bound a slot's cost is held to (None: costs not watched)


@dataclass(frozen=True)
class Request:
    kind: int
    set: int
    verdict: bool
    seq: int
    ops: list[Op]
    rows: np.ndarray  # int32
    slots: np.ndarray  # int32
    tokens: np.ndarray | None  # int32, STEP and DRAFTS only
    mark: int = 0  # the set's flag once done (0: none)
    leads: list[list[int]] | None = None  # STEP: each slot's tokens before its own (None: none)


def encode_request(
    kind: int,
    set_index: int,
    seq: int,
    ops: list[Op],
    rows: list[int],
    slots: list[int],
    tokens: list[int] | None = None,
    verdict: bool = False,
    mark: int = 0,
    leads: list[list[int]] | None = None,
) -> bytes:
    blob = pickle.dumps(ops) if ops else b""
    num_leads = sum(map(len, leads)) if leads else 0
    parts = [_REQUEST.pack(kind, set_index, verdict, seq, len(rows), len(blob), mark, num_leads), blob]
    parts += [np.asarray(a, dtype=np.int32).tobytes() for a in (rows, slots) if a is not None]
    if tokens is not None:
        parts.append(np.asarray(tokens, dtype=np.int32).tobytes())
    if leads and num_leads:
        parts.append(np.asarray([len(run) for run in leads], dtype=np.int32).tobytes())
        parts.append(np.asarray([t for run in leads for t in run], dtype=np.int32).tobytes())
    return b"".join(parts)


def decode_request(data: bytes) -> Request:
    kind, set_index, verdict, seq, n, blob, mark, num_leads = _REQUEST.unpack_from(data)
    at = _REQUEST.size
    ops: list[Op] = pickle.loads(data[at : at + blob]) if blob else []
    at += blob
    with_tokens = kind in (STEP, DRAFTS)
    arrays = [np.frombuffer(data, np.int32, n, at + 4 * n * k) for k in range(3 if with_tokens else 2)]
    if kind in (OPS, MARK):
        arrays = [np.zeros(0, np.int32)] * 2
    tokens = arrays[2] if with_tokens else None
    leads = None
    if num_leads:
        at += 4 * n * 3
        counts = np.frombuffer(data, np.int32, n, at).tolist()
        flat = np.frombuffer(data, np.int32, num_leads, at + 4 * n).tolist()
        ends = np.cumsum([0, *counts]).tolist()
        leads = [flat[ends[i] : ends[i + 1]] for i in range(n)]
    return Request(kind, set_index, bool(verdict), seq, ops, arrays[0], arrays[1], tokens, mark, leads)


def encode_reply(kind: int, seq: int, payload: dict[int, str] | str | None = None) -> bytes:
    blob = pickle.dumps(payload) if payload else b""
    return _REPLY.pack(kind, seq, len(blob)) + blob


def decode_reply(data: bytes) -> tuple[int, int, Any]:
    """(kind, seq, payload): errors by slot ({} when none), or FAILED's traceback."""
    kind, seq, blob = _REPLY.unpack_from(data)
    payload = pickle.loads(data[_REPLY.size : _REPLY.size + blob]) if blob else ({} if kind != FAILED else "")
    return kind, seq, payload
