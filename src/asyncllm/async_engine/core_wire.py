"""What crosses the pipes between a front and its core process: the message kinds, and one step's outputs
in the compact form they travel in.

Every message is one pickled tuple whose first item is its kind. A step's outputs are mostly plain deltas
(one token, its text, nothing else); they travel as three columns (ids, tokens, texts), which pickle and
unpickle in a small fraction of the time the same `RequestDelta`s would take (a slotted dataclass pickles
through Python code, field by field); the rest (a final delta, logprobs, a sample's index, an error) travel
as they are, with their place in the step's order. Errors travel as themselves when they pickle, else as a
`RuntimeError` carrying their text. Knows nothing of processes, pipes or event loops.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from asyncllm.core.engine_stats import SPEC_POSITION_KEY
from asyncllm.core.output_processor import RequestDelta
from asyncllm.errors import AsyncLLMError, RequestFailedError

# front -> core
ADD = "add"  # (ADD, request)
ABORT = "abort"  # (ABORT, request_id)
END = "end"  # (END, request_id, delta): routed back in order, for a request that never reached the core
CALL = "call"  # (CALL, call id, what, args): CHECK_CONSTRAINT(spec), ADD_LORA(name, path), REMOVE_LORA(name)
STOP = "stop"  # (STOP,): stop after the step in flight, release the device, exit
# core -> front
READY = "ready"  # (READY, runtime, tokenizer, encode, encode_batch, can check constraints)
FAILED = "failed"  # (FAILED, error): the build failed
STEP = "step"  # (STEP, started ids, stats, ids, tokens, texts, others): see `encode_step`
RETURNED = "returned"  # (RETURNED, call id, error or None)
# What a CALL asks for: a constraint compiled on a thread of its own; adapters changed between two steps.
CHECK_CONSTRAINT, ADD_LORA, REMOVE_LORA = "check_constraint", "add_lora", "remove_lora"
DEAD = "dead"  # (DEAD, message, cause): the core is gone (failed, or shut down); streams end with it

# `RequestDelta`'s fields beyond the columns a plain delta travels as: `encode_step` checks each is at its
# default (a test fails when the dataclass gains a field this list and that check do not know).
EXTRA_FIELDS = ("finish_reason", "metrics", "logprobs", "error", "index", "open_samples", "prompt_logprobs", "pooled")
STATS_KEYS = (
    "num_running",
    "num_waiting",
    "num_free_blocks",
    "num_total_blocks",
    "prefix_cache_hit_rate",
    "num_preemptions",
    "num_steps",
    "prefix_cache_queried_tokens",  # the hit rate's terms: /metrics counts them (vLLM's prefix_cache_*)
    "prefix_cache_hit_tokens",
    "spec_draft_tokens",  # speculative decoding's running totals
    "spec_accepted_tokens",
    "spec_num_drafts",
    "spec_chained_drafts",
    "spec_void_drafts",
    "prefix_cache_host_hit_tokens",  # of the hits, those restored from the KV tiers below the device
    "prefix_cache_disk_hit_tokens",
    "cuda_graphs_pending",
)


def encode_step(started: list[str], stats: dict[str, float | int], deltas: list[RequestDelta]) -> tuple[Any, ...]:
    """One step's message: the ids started, the stats snapshot (values in `STATS_KEYS` order) and the deltas
        (plain ones as columns; `others` as (position in the step's list, delta, its error's cause)). The
    core's deltas are its own to give away: an error that would not pickle is replaced in place."""
    ids: list[str] = []
    tokens: list[int] = []
    texts: list[str] = []
    others: list[tuple[int, RequestDelta, BaseException | None]] = []
    for position, d in enumerate(deltas):
        new = d.new_token_ids
        if (  # every field but the three columns at its default (`EXTRA_FIELDS`)
            len(new) == 1
            and d.finish_reason is None
            and d.metrics is None
            and d.logprobs is None
            and d.error is None
            and d.index == 0
            and d.open_samples == 0
            and d.prompt_logprobs is None
            and d.pooled is None
        ):
            ids.append(d.request_id)
            tokens.append(new[0])
            texts.append(d.new_text)
        else:  # pickle drops an error's cause: it travels beside it
            error = d.error
            if isinstance(error, AsyncLLMError):
                portable = portable_error(error)
                d.error = portable if isinstance(portable, AsyncLLMError) else RequestFailedError(str(portable))
                others.append((position, d, None if error.__cause__ is None else portable_error(error.__cause__)))
            else:
                others.append((position, d, None))
    # Then accepted drafts by position, as many as the engine drafts (0 without speculation).
    positions = tuple(stats[key] for key in stats if key.startswith(SPEC_POSITION_KEY))
    values = tuple(stats.get(key, 0) for key in STATS_KEYS) + positions
    return (STEP, started, values, ids, tokens, texts, others)


def decode_step(message: tuple[Any, ...]) -> tuple[list[str], dict[str, float | int], list[RequestDelta]]:
    """`encode_step`'s (started ids, stats, deltas in the step's order)."""
    _, started, values, ids, tokens, texts, others = message
    deltas = [RequestDelta(rid, [token], text) for rid, token, text in zip(ids, tokens, texts)]
    for position, delta, cause in others:  # ascending positions: each lands where it was
        if cause is not None:
            assert isinstance(delta.error, BaseException)
            delta.error.__cause__ = cause
        deltas.insert(position, delta)
    stats = dict(zip(STATS_KEYS, values))
    for position, count in enumerate(values[len(STATS_KEYS) :]):
        stats[f"{SPEC_POSITION_KEY}{position}"] = count
    return started, stats, deltas


def portable_error(error: BaseException) -> BaseException:
    """`error` if it survives a round trip through pickle, else a RuntimeError with its type, text and
    traceback (an error whose class takes other arguments, or holds an unpicklable object)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return RuntimeError(f"{type(error).__name__}: {error} (in the engine core process)\n{text}")
    return error
