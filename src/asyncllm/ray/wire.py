"""What crosses between a pool's front and one replica actor: plain picklable data (no Ray, no torch).

The front sends a replica its requests and aborts in numbered batches of `AddRequest` and `AbortRequest`; the
replica streams back `Batch`es, each the outputs of one or more steps with the stats taken after them, the
last one of an engine that died saying why. `ReplicaInfo` is what a started replica tells the front:
enough to check and tokenize its requests there. Knows nothing of how either side uses them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncllm.core.output_processor import RequestDelta
    from asyncllm.core.request import Request
    from asyncllm.step import RuntimeInfo


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: Request  # checked and tokenized by the front
    waited: float  # seconds since its arrival when sent: the replica rebases the arrival on its own clock


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


Message = AddRequest | AbortRequest


@dataclass(slots=True)
class Batch:
    """Outputs of the steps since the previous batch, in order, and the replica's state after them."""

    deltas: list[RequestDelta] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # requests whose first step was planned
    stats: dict[str, float | int] = field(default_factory=dict)  # the core's snapshot after these steps
    busy: bool = False  # a step is in flight or due: the replica has work
    dead: tuple[str, BaseException | None] | None = None  # the engine is gone (message, cause): the last batch


@dataclass(frozen=True)
class ReplicaInfo:
    runtime: RuntimeInfo
    tokenizer: Any  # the Hugging Face tokenizer (chat templates), None if the checkpoint has none
    encode: Callable[[str], list[int]] | None  # text to prompt ids, run in the front's process
    encode_batch: Callable[[list[str]], list[list[int]]] | None
    checks_constraints: bool  # the replica can compile output constraints (`check_constraint`)
    pid: int  # the replica's process, on node `node_id`
    node_id: str
    stats: dict[str, float | int]  # its engine's stats once built (later ones come with its batches)


def portable(error: BaseException | None) -> BaseException | None:
    """`error` if it survives pickling (it crosses to the front), else a RuntimeError naming it."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(repr(error))
    return error
