"""Turns one step's logits into next tokens: logit bias, stop masks, penalties, filters, then one seeded Gumbel-max.

Everything happens in logit space. Every row ends in one launch (`asyncllm.kernels.sampling.gumbel_argmax`,
or its torch twin where Triton cannot run): greedy rows take the argmax, others the argmax of
logits / temperature plus noise that is a pure function of the request's seed and draw count, so a
request's tokens depend only on its own logits and seed, never on the rest of the batch. Rows that ask for
penalties, filters or min_tokens masking are processed in float32 first; the common case touches the logits
only in that one launch. Constrained rows (structured output) carry a token bitmask that the draw applies
in the same launch (greedy rows too); rows that are also filtered are masked before top-k/top-p/min-p, so
the filters choose among allowed tokens only. Logprobs are those of the raw logits, before any of this.
Nothing here waits for the device. Knows nothing of scheduling or the model.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncllm.kernels.sampling_ref import apply_token_bitmask_ref
from asyncllm.layers.host_copy import to_device
from asyncllm.sample.features import takes_plain_draw
from asyncllm.sample.filters import apply_min_p, apply_top_k_top_p
from asyncllm.sample.logprobs import LogprobsOutput, gather_logprobs
from asyncllm.sample.penalties import PenaltyTable
from asyncllm.sample.state import SamplingState

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingState",
    "TokenMask",
    "apply_min_p",
    "apply_top_k_top_p",
    "takes_plain_draw",
]


class Draw(Protocol):
    """`gumbel_argmax` (kernels/sampling.py) or its torch twin: [R] int64 tokens."""

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        offsets: torch.Tensor,
        bitmask: torch.Tensor | None = None,
        mask_rows: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass
class TokenMask:
    """What the sampler applies: bitmask row `mask_rows[r]` to logits row r (-1: unconstrained). The one
    thing structured output hands the sampler (`structured_output/grammar_table.py` fills and uploads it)."""

    bitmask: torch.Tensor  # [C, W] int32 on the device, xgrammar's layout (bit t % 32 of word t // 32)
    mask_rows: torch.Tensor  # [S] int64 on the device


@dataclass
class DrawInputs:
    """A step's per-row draw parameters on the device (`DrawParams.on_device`)."""

    temperatures: torch.Tensor  # [N] float32; 0 = greedy
    seeds: torch.Tensor  # [N] int64
    offsets: torch.Tensor  # [N] int64


@dataclass
class DrawParams:
    """A step's per-row draw parameters on the host (`Sampler.draw_params`): the caller uploads both lists
    (the worker stages them with the step's inputs) and hands the device tensors to `on_device`."""

    counters: list[int]  # int64: N seeds, zeros up to an even count m, then N draw offsets (at index m)
    temperatures: list[float]  # [N] float32; 0 = greedy

    def on_device(self, counters: torch.Tensor, temperatures: torch.Tensor) -> DrawInputs:
        n = len(self.temperatures)
        m = len(self.counters) - n
        return DrawInputs(temperatures, counters[:n], counters[m:])

    def upload(self, device: torch.device) -> DrawInputs:
        """Both lists uploaded at once (a draw outside a worker's step)."""
        return self.on_device(
            to_device(self.counters, torch.int64, device), to_device(self.temperatures, torch.float32, device)
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64, on the logits' device
    logprobs_output: LogprobsOutput | None = None  # rows that asked for logprobs, still on the device

    @property
    def logprobs(self) -> list[dict[int, float] | None] | None:
        """Per row: {token: logprob} for the sampled token and the top alternatives (None for rows that did
        not ask). Reading it waits for the device."""
        return None if self.logprobs_output is None else self.logprobs_output.to_dicts()


def load_draw(device: torch.device) -> Draw:
    """The Triton kernel on CUDA; on CPU `gumbel_argmax_cpu` (the torch twin's tokens, computed in cache-sized
    int32 blocks: ~4x faster at one row); the torch twin itself elsewhere. tests/kernels holds all three to
    the same tokens (the kernel through Triton's interpreter)."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        kernels = importlib.import_module("asyncllm.kernels.sampling")
        return kernels.gumbel_argmax  # type: ignore[no-any-return]
    draw: Draw
    if device.type == "cpu":
        from asyncllm.kernels.sampling_cpu import gumbel_argmax_cpu

        draw = gumbel_argmax_cpu
    else:
        from asyncllm.kernels.sampling_ref import gumbel_argmax_ref

        draw = gumbel_argmax_ref
    return draw


class Sampler:
    """`Sampler(vocab_size, device)`; requests with penalties must be `add`ed (and `remove`d when done)."""

    def __init__(self, vocab_size: int, device: torch.device | str, draw: Draw | None = None) -> None:
        self.device = torch.device(device)
        self.penalties = PenaltyTable(vocab_size, self.device)
        self._draw = draw or load_draw(self.device)

    @property
    def draw(self) -> Draw:
        """The draw this sampler launches (the Triton kernel on CUDA)."""
        return self._draw

    def add(self, state: SamplingState) -> None:
        self.penalties.add(state)

    def remove(self, state: SamplingState) -> None:
        self.penalties.remove(state)

    def draw_params(
        self, states: Sequence[SamplingState], masked: bool = False, ahead: Sequence[int] | None = None
    ) -> DrawParams | None:
        """The draw's per-row parameters, on the host (None when every row is greedy and none is `masked`:
        no draw, an argmax). Uploaded before the step's forward pass; the draw itself (`__call__`) comes
        after. `masked`: some row has a grammar (the draw applies its mask, greedy rows included). `ahead`:
        per row, draws of its request before it in this step (rows verifying drafts: the noise offset each
        position would take without them)."""
        if not masked and all(s.greedy for s in states):
            return None
        temperature = [0.0 if s.greedy else (1.0 if s.filters else s.params.temperature) for s in states]
        n = len(states)
        # Offsets start at an even index, 16-byte aligned whatever n is: Triton specialises a kernel on its
        # pointers' alignment, and an odd n compiled a second variant of the draw kernel mid-serving.
        m = n + (n & 1)
        seeds = [s.seed for s in states] + [0] * (m - n)
        offsets = [s.num_sampled for s in states]
        if ahead is not None:
            offsets = [o + a for o, a in zip(offsets, ahead, strict=True)]
        return DrawParams(seeds + offsets, temperature)

    def __call__(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        draw: DrawInputs | None = None,
        mask: TokenMask | None = None,
        skip: Collection[int] = (),
        before: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row. `draw`: `draw_params(states)` on the device, sent before this call;
        without it the parameters are uploaded here. `mask`: the bitmask of the constrained rows (those
        whose state is `constrained`); a row it allows nothing gets token 0, which its caller reports.
        `skip`: rows whose draw does not count (deferred: their token is never output): their requests'
        next draw takes this one's noise offset, and their penalties do not count its token. `before`: per row,
        the drafts its draw follows in this step (verifying): min_tokens and the penalties count them."""
        if logits.dim() != 2 or logits.shape[0] != len(states) or not logits.dtype.is_floating_point:
            raise ValueError(
                f"Sampler: logits must be a float [num_states={len(states)}, vocab] tensor, "
                f"got {tuple(logits.shape)} {logits.dtype}"
            )
        x = self._processed(logits, states, mask, before)
        if mask is None and all(s.greedy for s in states):
            token_ids = x.argmax(dim=-1)
        else:
            if draw is None:
                params = self.draw_params(states, masked=mask is not None)
                assert params is not None
                draw = params.upload(self.device)
            if mask is None:  # today's launch, unchanged
                token_ids = self._draw(x, draw.temperatures, draw.seeds, draw.offsets)
            else:
                token_ids = self._draw(x, draw.temperatures, draw.seeds, draw.offsets, mask.bitmask, mask.mask_rows)
        counted = [s for i, s in enumerate(states) if i not in skip] if skip else states
        self.drawn(counted)
        self.penalties.record(states, token_ids, skip)
        return SamplerOutput(token_ids, gather_logprobs(logits, token_ids, states))

    @staticmethod
    def drawn(states: Sequence[SamplingState]) -> None:
        """A draw of these rows is launched (here, or a plain draw in a CUDA graph): each one's next draw takes
        the next offset, known now with no sync."""
        for state in states:
            state.num_sampled += 1

    def _processed(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        mask: TokenMask | None,
        before: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """The logits the draw reads: untouched unless a row needs masking, penalties or filters; then a
        float32 copy with those rows rewritten (filtered rows already divided by their temperature, and
        those with a grammar already masked by it)."""
        if before is None:
            masked = [i for i, s in enumerate(states) if s.masks_stops]
        else:  # a row drawing after j drafts still masks while its count + j < min_tokens
            masked = [i for i, (s, b) in enumerate(zip(states, before)) if s.masks_stops_after(len(b))]
        penalised = any(s.penalty_row is not None for s in states)
        filtered = [i for i, s in enumerate(states) if s.filters and not s.greedy]
        biased = [(i, t, b) for i, s in enumerate(states) for t, b in s.params.bias_items]
        if not (masked or penalised or filtered or biased):
            return logits
        x = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        if biased:
            _add_bias(x, biased)
        if masked:
            _mask_stops(x, [(i, t) for i in masked for t in states[i].min_tokens_stop_ids])
        if penalised:
            self.penalties.apply(x, states, before)
        if filtered:
            self._filter(x, filtered, [states[i] for i in filtered], mask)
        return x

    def _filter(self, x: torch.Tensor, rows: list[int], states: list[SamplingState], mask: TokenMask | None) -> None:
        vocab = x.shape[1]
        params = [s.params for s in states]
        packed = to_device(
            [[float(r), p.temperature, p.top_p, p.min_p] for r, p in zip(rows, params)], torch.float32, self.device
        )  # [R, 4]
        row_index = packed[:, 0].long()
        sub = x.index_select(0, row_index) / packed[:, 1:2]  # a fresh tensor: the filters write into it
        if mask is not None and any(s.constrained for s in states):
            # Before the filters: top-k of the unmasked row could keep only tokens the grammar forbids.
            apply_token_bitmask_ref(sub, mask.bitmask, mask.mask_rows.index_select(0, row_index))
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # vocab means "off"
        k_rows = to_device(top_k, torch.int64, self.device) if any(k < vocab for k in top_k) else None
        p_rows = packed[:, 2] if any(p.top_p < 1.0 for p in params) else None
        if k_rows is not None or p_rows is not None:
            sub = apply_top_k_top_p(sub, k_rows, p_rows, max_k=max((k for k in top_k if k < vocab), default=None))
        if any(p.min_p > 0.0 for p in params):
            sub = apply_min_p(sub, packed[:, 3])
        x.index_copy_(0, row_index, sub)


def _add_bias(x: torch.Tensor, entries: list[tuple[int, int, float]]) -> None:
    """OpenAI's logit_bias: (row, token, bias) added to the raw logits, first (ids beyond them change nothing)."""
    keep = [(r, t, b) for r, t, b in entries if t < x.shape[1]]
    if keep:
        index = to_device([v for r, t, _ in keep for v in (r, t)], torch.int64, x.device).view(-1, 2)
        bias = to_device([b for _, _, b in keep], torch.float32, x.device)
        x.index_put_((index[:, 0], index[:, 1]), bias, accumulate=True)


def _mask_stops(x: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Until a request has `min_tokens` outputs its EOS and stop ids cannot be drawn (vLLM's rule), so a
    short answer is never padded with an end-of-text token it was not allowed to stop on."""
    keep = [(r, c) for r, c in pairs if c < x.shape[1]]
    if keep:
        index = to_device([v for pair in keep for v in pair], torch.int64, x.device).view(-1, 2)
        x[index[:, 0], index[:, 1]] = float("-inf")
