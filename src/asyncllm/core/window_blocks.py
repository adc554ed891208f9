"""`WindowedBlockManager`: the block manager for a model whose every layer attends within a sliding window
(Mistral's `sliding_window`): a running request's blocks wholly behind the window of the next token it
computes go back to the pool, so a long sequence holds about `window` tokens of KV, not all of them.

Why only then: a global layer (Gemma 3 interleaves one every few sliding ones) reads every key of the
sequence, so its blocks stay live to the end. Why it is safe: every query a request computes from now on
sits at or after `num_computed_tokens`, so keys more than `window - 1` positions before it are never read
again, by any layer (the attention kernels do not even load them). Steps run in order, so a block given
back while planning step N, and written by its new owner in step N, was last read by step N - 1 at the
latest. A given-back block keeps its prefix hash: it is free, and cached like any freed block (a later
request with the same prefix may take it back; taken for other content, it leaves the index first).

The request's `block_ids` keep the given-back entries (the table stays indexed by position: token t lives in
entry t // block_size); only its live tail is referenced. Samples of a request with n > 1 share their
prompt's blocks through their group (`sample_group.py`), so theirs are kept to the end. Plain Python; knows
nothing of tensors.
"""

from __future__ import annotations

from asyncllm.core.block_manager import BlockManager, KVBlock
from asyncllm.core.request import Request
from asyncllm.step import KVTierInfo


class WindowedBlockManager(BlockManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        window: int,
        tiers: KVTierInfo | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, tiers)
        if window < 1:
            raise ValueError(f"need a sliding window >= 1, got {window}")
        self.window = window
        self._num_released: dict[str, int] = {}  # request id -> leading blocks given back

    def held_block_ids(self, request: Request) -> list[int]:
        """The blocks `request` references: its table past the entries given back."""
        return request.block_ids[self._num_released.get(request.request_id, 0) :]

    def allocate(self, request: Request, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        """`BlockManager.allocate`, after giving back the running request's blocks behind its window: dead
        whatever this allocation does, so they go back even when it fails for want of memory."""
        if not cached and request.block_ids and request.group_id is None:
            # Keys before `num_computed_tokens - window + 1` are outside every query still to come.
            dead = (request.num_computed_tokens - self.window + 1) // self.block_size
            released = self._num_released.get(request.request_id, 0)
            if dead > released:
                self.release(request.block_ids[released:dead])
                self._num_released[request.request_id] = dead
        return super().allocate(request, num_new_tokens, cached)

    def free(self, request: Request) -> None:
        del request.block_ids[: self._num_released.pop(request.request_id, 0)]
        super().free(request)
