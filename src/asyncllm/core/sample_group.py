"""Several samples of one prompt (`SamplingParams.n` > 1): the samples as requests of their own, the prompt
blocks they share, and their deltas relabelled as the request's. Plain Python, like the rest of the core;
knows nothing of streams, nor of how the runner computes KV.

Each sample is a `Request` named `"{request_id}[{i}]"` to the scheduler and the runner: its own seed, stops,
length, grammar matcher and preemption. What the samples share is the prompt's KV: its full blocks but the
one holding its last token (`num_shared_blocks`) are computed once, by the first sample admitted, and every
other sample takes a reference on them (the block manager's ref counts, whatever the prefix-cache setting),
then computes only the prompt's tail: 1 to `block_size` tokens, the last of which every sample must compute
anyway, since its logits draw that sample's first token. Why the tail is recomputed rather than its block
copied on the device: the runner and the step contract stay as they are (a copy would also need one row of
logits drawn from n times with n seeds), each sample's first token is drawn exactly as an independent
request's, and the cost is at most `block_size` tokens per sample beside a prompt computed once, not n times.
Prompt logprobs are the request's: sample 0 alone asks for them, so it computes the whole prompt (it shares
nothing) and the others share its blocks as usual.

The group may hold the prompt's blocks itself (`held`) while samples wait for their first admission and no
admitted sample holds them (say the first one finished before the others found a seat); it lets go once
they are all admitted, and whenever memory is short and no sample of the group runs (`release_if_idle`),
so a hold never blocks another request.
"""

from __future__ import annotations

from dataclasses import replace

from asyncllm.core.block_manager import BlockManager, KVBlock
from asyncllm.core.output_processor import RequestDelta
from asyncllm.core.request import Request, RequestStatus
from asyncllm.errors import InvalidRequestError


def sample_id(request_id: str, index: int) -> str:
    """The id the scheduler and the runner know sample `index` of request `request_id` by."""
    return f"{request_id}[{index}]"


class SampleGroup:
    """The samples of one request, and the prompt blocks they share (see the module)."""

    __slots__ = ("held", "num_open", "num_shared_blocks", "num_unadmitted", "request_id", "samples")

    def __init__(self, request: Request, block_size: int) -> None:
        self.request_id = request.request_id
        params = request.params
        others = replace(params, prompt_logprobs=None) if params.prompt_logprobs is not None else params
        self.samples = [
            Request(
                sample_id(request.request_id, i),
                request.prompt_token_ids,
                params if i == 0 else others,
                request.arrival_time,
                request.max_tokens,
                request.eos_token_ids,
                group_id=self.request_id,
                priority=request.priority,
                lora_name=request.lora_name,
                lora_id=request.lora_id,
                deadline=request.deadline,
                speculative=request.speculative,
            )
            for i in range(request.params.n)
        ]
        # The last prompt token is always computed by each sample (its logits draw the first token).
        self.num_shared_blocks = (request.num_prompt_tokens - 1) // block_size
        self.num_unadmitted = len(self.samples)  # samples never admitted yet
        self.num_open = len(self.samples)  # samples whose final output has not gone out
        self.held: list[int] = []  # prompt blocks the group itself references (see the module)

    # ------------------------------------------------------------------ the scheduler's hooks
    def shared_prefix(self, request: Request, bm: BlockManager) -> list[KVBlock] | None:
        """The prompt's full blocks for `request`, a sample being admitted with nothing computed: taken
        from the group's hold or a running sample that has planned them (its step writes them before the
        step that admits `request` reads them: steps run in order, and within one step every layer writes
        its keys and values before its attention reads). [] when no sample has them: `request` computes
        them itself. None while a running sample is computing them: wait for it rather than compute twice."""
        k = self.num_shared_blocks
        if k == 0:
            return []
        if self.held:
            return [bm.blocks[b] for b in self.held]
        computing = False
        for other in self.samples:
            if other is not request and other.status is RequestStatus.RUNNING:
                if other.num_computed_tokens >= k * bm.block_size:
                    return [bm.blocks[b] for b in other.block_ids[:k]]
                computing = True
        return None if computing else []

    def admitted(self, request: Request, bm: BlockManager) -> None:
        """`request` is being admitted (its status not yet RUNNING)."""
        if request.status is RequestStatus.WAITING:  # its first admission
            self.num_unadmitted -= 1
            if not self.num_unadmitted:
                self.release(bm)

    def finishing(self, request: Request, bm: BlockManager) -> bool:
        """`request` ends and its blocks are about to be freed; True when the group took a hold on the
        prompt's blocks from it, for samples not admitted yet."""
        if request.status is RequestStatus.WAITING:  # it will never be admitted now
            self.num_unadmitted -= 1
            if not self.num_unadmitted:
                self.release(bm)
            return False
        k = self.num_shared_blocks
        if self.held or not self.num_unadmitted or k == 0 or request.status is not RequestStatus.RUNNING:
            return False
        if request.num_computed_tokens < k * bm.block_size:
            return False
        self.held = request.block_ids[:k]
        bm.hold(self.held)
        return True

    def release_if_idle(self, bm: BlockManager) -> bool:
        """Memory is short: let go of the hold if no sample runs (its blocks may then be freed). True if so."""
        if not self.held or any(s.status is RequestStatus.RUNNING for s in self.samples):
            return False
        self.release(bm)
        return True

    def release(self, bm: BlockManager) -> None:
        if self.held:
            bm.release(self.held)
            self.held = []


class SampleGroups:
    """The engine core's live groups: creates them, and turns their samples' deltas into the request's
    (`request_id` the parent's, `index` the sample's, `open_samples` counting down to the final one)."""

    def __init__(self) -> None:
        self._groups: dict[str, SampleGroup] = {}
        self._sample_of: dict[str, tuple[SampleGroup, int]] = {}  # sample id -> (its group, its index)

    def __bool__(self) -> bool:
        return bool(self._sample_of)

    def get(self, request_id: str) -> SampleGroup | None:
        return self._groups.get(request_id)

    def create(self, request: Request, block_size: int, live: dict[str, Request]) -> SampleGroup:
        """The group of `request` (n > 1), registered; raises, changing nothing, if an id is taken."""
        group = SampleGroup(request, block_size)
        for rid in (request.request_id, *(s.request_id for s in group.samples)):
            if rid in live or rid in self._groups:
                raise InvalidRequestError(f"request_id={rid!r} is already live: give another id")
        self._groups[request.request_id] = group
        for i, sample in enumerate(group.samples):
            self._sample_of[sample.request_id] = (group, i)
        return group

    def label(self, deltas: list[RequestDelta]) -> None:
        """Give the deltas of samples their request's id and their sample's index, in place."""
        sample_of = self._sample_of
        for delta in deltas:
            found = sample_of.get(delta.request_id)
            if found is None:
                continue
            group, index = found
            if delta.finish_reason is not None or delta.error is not None:
                del sample_of[delta.request_id]
                group.num_open -= 1
                delta.open_samples = group.num_open
                if not group.num_open:
                    del self._groups[group.request_id]
            delta.request_id = group.request_id
            delta.index = index
