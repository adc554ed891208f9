"""What the runner's two drafting methods (draft_model.py, eagle3.py) share around their own drafting: which rows
of a step may not draft, the step handed back with its proposals, and greedy draft steps read back per row.
Knows nothing of either method's model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from asyncllm.step import ModelRunnerOutput, ReadyStep, StepResult


class DraftRow(Protocol):
    @property
    def index(self) -> int: ...  # the row among the step's sampled rows


Row = TypeVar("Row", bound=DraftRow)


def not_drafting(out: ModelRunnerOutput) -> set[int]:
    """Sampled rows that get no proposal: failed, sitting out (their constraint's mask was not ready), or with a
    forced run after their token (the request's last token is not the step's)."""
    return set(out.failed or ()) | set(out.deferred or ()) | set(out.forced or ())


def with_drafts(
    step: StepResult, rows_of: Callable[[ModelRunnerOutput], list[Row]], draft: Callable[[list[Row]], list[list[int]]]
) -> StepResult:
    """`step` read, with `draft(rows)`'s proposals for the rows `rows_of` picks from it (none: as it is)."""
    out = step.result()
    rows = rows_of(out)
    if not rows:
        return ReadyStep(out)
    drafts: Sequence[list[int]] = draft(rows)
    return ReadyStep(dataclasses.replace(out, drafts={row.index: d for row, d in zip(rows, drafts)}))


def drafts_by_row(steps: list[torch.Tensor], num_rows: int) -> list[list[int]]:
    """The drafts of `num_rows` rows sorted by room, from the tokens of each greedy draft step (`steps[j]`:
    [rows still drafting at step j], a prefix of the rows), read to the host in one go."""
    drafted = torch.cat(steps).tolist()
    out: list[list[int]] = [[] for _ in range(num_rows)]
    at = 0
    for step in steps:
        for i in range(step.shape[0]):
            out[i].append(drafted[at + i])
        at += step.shape[0]
    return out
