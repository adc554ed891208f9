"""Per-request sampling state the model runner keeps across steps, and batch tensors built from it.

Owns each request's seeded generator and the token history penalties read. Knows nothing of scheduling,
of the model, or of how logits are turned into tokens (that is `sampler.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asyncllm.sampling_params import SamplingParams

# torch.Generator.manual_seed accepts 64-bit values only; any Python int seed is folded into that range
# so every request seed is accepted and still maps to one fixed stream.
_SEED_MASK = (1 << 64) - 1


class HostTokens:
    """A host int64 copy of a token list that only grows, extended by its new tail in amortised O(1).

    torch.tensor(list) costs tens of ns a token; redone every step for hundreds of requests with long
    histories it would dominate the step. The list stays the source of truth: if it is replaced or
    shrinks, the copy is rebuilt.
    """

    def __init__(self) -> None:
        self._source: list[int] | None = None
        self._buffer = torch.empty(0, dtype=torch.int64)  # capacity doubles as the list grows
        self._size = 0

    def sync(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens)] int64 view matching `tokens` now."""
        if tokens is not self._source or len(tokens) < self._size:
            self._source, self._size = tokens, 0
        if len(tokens) > self._size:
            if len(tokens) > self._buffer.numel():
                grown = torch.empty(max(len(tokens), 2 * self._buffer.numel()), dtype=torch.int64)
                grown[: self._size] = self._buffer[: self._size]
                self._buffer = grown
            self._buffer[self._size : len(tokens)] = torch.tensor(tokens[self._size :], dtype=torch.int64)
            self._size = len(tokens)
        return self._buffer[: self._size]


@dataclass
class SamplingState:
    """One live request's sampling inputs. The runner appends every sampled token with `record`."""

    params: SamplingParams
    generator: torch.Generator  # on the logits' device; only this request's noise is drawn from it
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # EOS (unless ignore_eos) and stop_token_ids: masked while fewer than params.min_tokens outputs exist.
    min_tokens_stop_ids: tuple[int, ...] = ()
    _prompt_host: HostTokens = field(default_factory=HostTokens, init=False, repr=False, compare=False)
    _output_host: HostTokens = field(default_factory=HostTokens, init=False, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        seed: int,
        prompt_token_ids: Sequence[int],
        device: torch.device | str,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SamplingState:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed & _SEED_MASK)
        stops: tuple[int, ...] = ()
        if params.min_tokens > 0:
            stops = tuple(sorted(params.stop_token_set | (frozenset() if params.ignore_eos else eos_token_ids)))
        return cls(
            params=params, generator=generator, prompt_token_ids=list(prompt_token_ids), min_tokens_stop_ids=stops
        )

    def record(self, token_id: int) -> None:
        """Add one sampled token to the history that presence/frequency/repetition penalties see."""
        self.output_token_ids.append(token_id)

    def prompt_tensor(self) -> torch.Tensor:
        """[len(prompt)] int64 on the host, converted once rather than every step."""
        return self._prompt_host.sync(self.prompt_token_ids)

    def output_tensor(self) -> torch.Tensor:
        """[len(output)] int64 on the host; each call converts only the tokens recorded since the last."""
        return self._output_host.sync(self.output_token_ids)
