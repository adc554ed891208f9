"""`GraphDraw`: a decode step's plain draw (`takes_plain_draw`: every row temperature or greedy, nothing else)
and the record of its tokens as the requests' latest (`LatestTokens`), captured as a small CUDA graph per decode
bucket that replays right after the bucket's forward graph (which ran the LM head into its static logits).

A graph reads fixed addresses only, so the draw's per-row parameters (temperatures, seeds, offsets) and the
rows' latest-token slots have fixed regions of the step's staging, written by `stage` and sent by the step's
one flush; padding rows of the bucket record into `PAD_SLOT`. The launch is the sampler's own draw over the
same logits with the same parameters: the tokens are the eager path's, bit for bit (the kernel's argmax is
the first column of the best score whatever its vocabulary splits, which follow the row count; an all-greedy
step, which the eager sampler gives to torch.argmax, gets the kernel's temperature-0 argmax: the same first
column of the maximum, unless a row holds NaN, which torch's argmax picks and the kernel never does). Steps with any
other row (filters, penalties, logprobs, stop masks, grammars) take the eager sampler over the static logits.
Knows nothing of requests beyond their sampling states, nor of the model.
"""

from __future__ import annotations

import logging

import torch

from asyncllm.sample.sampler import Draw, DrawParams
from asyncllm.worker.latest_tokens import PAD_SLOT, LatestTokens
from asyncllm.worker.step_staging import PrefixViews, StepStaging

logger = logging.getLogger(__name__)


class GraphDraw:
    def __init__(self, staging: StepStaging, max_rows: int, latest: LatestTokens, draw: Draw) -> None:
        # Fixed regions, declared with the other fixed regions before the staging is first used.
        self.temperatures = staging.region(max_rows, torch.float32)  # [max_rows]; 0 = greedy
        self.seeds = staging.region(max_rows, torch.int64)
        self.offsets = staging.region(max_rows, torch.int64)
        self.slots = staging.region(max_rows, torch.int64)  # each row's latest-token slot; PAD_SLOT: padding
        self.max_rows = max_rows
        self._latest = latest
        self._draw = draw
        # The drawn ids, at a fixed address outside the graphs' pool: [max_rows] int64.
        self._tokens = PrefixViews(torch.zeros(max_rows, dtype=torch.int64, device=latest.device))
        self._recorded_into: torch.Tensor | None = None  # the latest tokens' tensor the captured graphs write

    def stage(self, params: DrawParams | None, slots: list[int], rows: int) -> None:
        """Write a step's draw into the fixed regions (host side; the step's flush sends it): `params` from
        `Sampler.draw_params` (None: every row greedy), the sampled rows' `slots`, and `rows`, the bucket's
        size: its padding rows record into the pad slot. Padding rows' other parameters keep whatever finite
        values an earlier step left: nothing reads their tokens."""
        n = len(slots)
        assert n <= rows <= self.max_rows, (n, rows, self.max_rows)
        if params is None:
            self.temperatures.touch(n)[:] = 0.0  # greedy rows read neither seed nor offset
        else:
            m = len(params.counters) - n  # DrawParams: n seeds, zeros up to an even m, then n offsets
            self.temperatures.put(params.temperatures)
            self.seeds.put(params.counters[:n])
            self.offsets.put(params.counters[m:])
        self.slots.put(slots)
        if rows > n:
            self.slots.touch(rows)[n:] = PAD_SLOT

    def launch(self, logits: torch.Tensor) -> None:
        """Draw every row of `logits` ([rows, vocab], a decode bucket's static logits) from the staged
        parameters and record the ids as the latest of the rows' slots: what the graph of that size captures
        (`CudaGraphRunner.capture`'s tail)."""
        rows = logits.shape[0]
        out = self._tokens(rows)
        t, s, o = self.temperatures.view(rows), self.seeds.view(rows), self.offsets.view(rows)
        self._draw(logits, t, s, o, out=out)
        self._latest.record(self.slots.view(rows), out)
        self._recorded_into = self._latest.tokens

    def ready(self) -> bool:
        """Whether the captured graphs still record into the latest tokens' tensor (it grows past its capacity
        only with more live requests than it holds: then every step samples eagerly, said once in the log)."""
        if self._recorded_into is self._latest.tokens:
            return True
        if self._recorded_into is not None:
            self._recorded_into = None  # warn once
            logger.warning(
                "ASYNCLLM_CUDA_GRAPH_SAMPLING: more live requests than the latest-token slots the draw graphs were "
                "captured with; decode steps sample eagerly from now on (same tokens, a few more launches a step)"
            )
        return False

    def tokens(self, n: int) -> torch.Tensor:
        """The first n drawn ids ([n] int64 on the device), once the step's draw graph ran."""
        return self._tokens(n)
