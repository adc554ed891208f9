"""Pooling requests in the engine core: an embed or score engine's request (`Request.pooling`) runs its
whole prompt in one step (the scheduler admits it only whole), samples nothing, and ends when that step's
output brings its vector (`ModelRunnerOutput.pooled`): its blocks are freed then, so a pooling engine's KV
cache holds no more than the steps in flight. Admission, priority, deadlines and aborts are the generation
path's, unchanged. Plain Python.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncllm.core.output_processor import RequestDelta
from asyncllm.outputs import FinishReason
from asyncllm.step import SchedulerOutput

# Ends a live request and returns its final delta (None: it had ended already, aborted or timed out).
Finish = Callable[[str, FinishReason], RequestDelta | None]


def finish_pooled(scheduled: SchedulerOutput, pooled: list[list[float]], finish: Finish) -> list[RequestDelta]:
    """The final deltas of a pooling step's requests, each carrying its vector (`RequestDelta.pooled`). A
    request aborted or timed out while its step ran has ended already: its vector is dropped."""
    sampling = [seq.request_id for seq in scheduled.seqs if seq.sample]
    assert len(sampling) == len(pooled), "one vector per pooled sequence"
    deltas = []
    for request_id, vector in zip(sampling, pooled):
        delta = finish(request_id, "stop")
        if delta is not None:
            delta.pooled = vector
            deltas.append(delta)
    return deltas
