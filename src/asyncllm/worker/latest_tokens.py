"""Each live request's most recently sampled token id, kept on the device in a slot of its own.

Overlapped scheduling plans a step before the previous one's tokens reach the host; such a step names the
missing input PLACEHOLDER and the runner fills it from here, on the device. A slot per request (not a row of
the last step's output) because a decode starved of token budget can skip a step. Slot 0 is no request's: a
draw captured in a CUDA graph records every row of its bucket, and its padding rows record there. Knows
nothing of models.
"""

from __future__ import annotations

import torch

PAD_SLOT = 0  # where rows of no request record (a graphed draw's padding); never handed out


class LatestTokens:
    """Slots on the device; the indices `record` and `feed` take are made on the host (`slots`,
    `feed_index`) for the caller to upload (the runner stages them with the step's inputs). The slots'
    tensor keeps its address until more than `capacity` requests are live at once (then it grows: `tokens`
    is a new tensor, which a CUDA graph that records into the old one must notice)."""

    def __init__(self, device: torch.device, capacity: int = 256) -> None:
        self.device = device
        self._tokens = torch.zeros(capacity + 1, dtype=torch.int64, device=device)  # [capacity + 1] by slot
        self._slot: dict[str, int] = {}
        self._free = list(range(capacity, PAD_SLOT, -1))

    @property
    def tokens(self) -> torch.Tensor:
        """The slots' device tensor, [capacity + 1] int64 (slot 0: padding)."""
        return self._tokens

    def add(self, request_id: str) -> None:
        if request_id in self._slot:
            return
        if not self._free:
            old = self._tokens.shape[0]
            self._tokens = torch.cat([self._tokens, torch.zeros_like(self._tokens)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        self._slot[request_id] = self._free.pop()

    def remove(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slots(self, request_ids: list[str]) -> list[int]:
        """The requests' slots (int64 on the device, for `record`)."""
        return [self._slot[r] for r in request_ids]

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Store a step's sampled ids ([len(slots)] int64 on the device) as the latest of the requests whose
        `slots` these are."""
        self._tokens.index_copy_(0, slots, token_ids)

    def feed_index(self, rows: list[int], request_ids: list[str]) -> list[int]:
        """The rows of `input_ids` to fill, then the slots of the requests to fill them from (int64 on the
        device, for `feed`)."""
        return rows + [self._slot[r] for r in request_ids]

    def feed(self, input_ids: torch.Tensor, index: torch.Tensor) -> None:
        """input_ids[rows[i]] = the latest token of request i (`index` from `feed_index`), on the device
        (stream-ordered after the step that sampled it)."""
        n = index.shape[0] // 2
        input_ids.index_copy_(0, index[:n], self._tokens.index_select(0, index[n:]))
