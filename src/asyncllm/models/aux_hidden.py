"""`AuxHidden`: the target's hidden states an EAGLE-3 head reads, copied out during the target's forward pass.

Layer id j names the residual stream entering decoder layer j (0: the embedding; the layer count: the stream
after the last layer, before the final norm), as vLLM and SGLang number them, so a head trained against their
capture reads the same values. A family's forward calls `capture` before each layer only when one is attached
(`CausalLM.aux_hidden`, set from outside: speculative_config's "eagle3"); without it nothing is copied.

The copies land in one preallocated buffer (a replayed CUDA graph writes the same memory), row t of a step
in row t, the layers side by side in the order given: [T, len(layers) * hidden].
"""

from __future__ import annotations

import torch


class AuxHidden:
    def __init__(
        self, layers: tuple[int, ...], hidden_size: int, max_tokens: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.layers = layers
        self.hidden_size = hidden_size
        self._columns: dict[int, list[int]] = {}  # layer id -> its places in `layers` (one id may repeat)
        for place, layer in enumerate(layers):
            self._columns.setdefault(layer, []).append(place)
        self.buffer = torch.zeros(max_tokens, len(layers) * hidden_size, device=device, dtype=dtype)

    def capture(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Copy the stream entering `layer` (x + residual, or x alone before the first) if it is one of ours."""
        places = self._columns.get(layer)
        if places is None:
            return
        rows = x.shape[0]
        if rows > self.buffer.shape[0]:  # a pass larger than the step's bound (profiling): never a graph's
            self.buffer = self.buffer.new_zeros(rows, self.buffer.shape[1])
        stream = x if residual is None else x + residual  # [T, hidden]
        h = self.hidden_size
        for place in places:
            self.buffer[:rows, place * h : (place + 1) * h].copy_(stream)
