"""`LoRAManager`: one worker's LoRA adapters: their packed host rows (added and removed between steps), the
device slots they are loaded into, and each step's rows per slot, staged with the step's other host data.

The core never runs more distinct adapters at once than there are slots (`max_loras`), so the adapters of any
one step fit: one not in a slot takes a free slot, else that of the least recently used adapter this step does
not use (one copy of a pool row, queued on the device's stream behind the steps that read the old one). Every
rank makes the same choices from the same steps. A step with no adapter row stages nothing and leaves the
layers inactive: it runs exactly as without LoRA, and so does every step while no live request has an adapter.
Knows requests only as ids with an adapter id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from asyncllm.errors import InvalidConfigError, LoRAError
from asyncllm.kernels.lora_plan import LORA_BLOCK_M, LORA_PATHS, max_lora_blocks, plan_lora_blocks, token_slots
from asyncllm.layers.lora import LoRABatch, LoRALinear
from asyncllm.model_loader.lora import read_peft_adapter
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.lora import LoRALayout, attach_lora, pack_adapter, padded_rank
from asyncllm.step import LoRAAdapter, SchedulerOutput
from asyncllm.worker.step_staging import StagedRegion, StepStaging


class LoRAManager:
    def __init__(
        self,
        model: CausalLM,
        arch: ModelArchConfig,  # the whole model's (unsharded): adapters are checked against it
        max_loras: int,
        max_lora_rank: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """Wrap `model`'s LoRA targets (`models/lora.py`) around a pool of `max_loras` zeroed slots on the
        model's device, in its dtype: allocated now, before the KV cache is sized."""
        weight = next(model.parameters())
        self.model = model
        self.arch = arch
        self.max_lora_rank = max_lora_rank
        self.num_slots = max_loras
        self.rank, self.world_size = rank, world_size
        self.layout = LoRALayout(model, padded_rank(max_lora_rank))
        if not self.layout.targets:  # e.g. every linear layer quantized (AWQ, GPTQ, FP8): LoRA wraps plain ones
            raise InvalidConfigError(
                "enable_lora=True, but this model has no layer LoRA adapters can apply to: its linear layers are "
                "quantized (docs/quantization.md); adapters apply to unquantized models only"
            )
        self.pool = torch.zeros(max_loras, self.layout.numel, dtype=weight.dtype, device=weight.device)
        self.batch = LoRABatch()
        attach_lora(model, self.layout, self.pool, self.batch)
        self._rows: dict[int, torch.Tensor] = {}  # lora_id -> its packed row, on the host (pinned on CUDA)
        self._slot_of: dict[int, int] = {}  # lora_id -> the slot holding it
        self._recent: OrderedDict[int, None] = OrderedDict()  # adapters in slots, least recently used first
        self._free = list(range(max_loras - 1, -1, -1))  # slots never used (or freed by a removal); pop() takes 0 first
        self._request_lora: dict[str, int] = {}  # live requests that have an adapter -> its id
        # The last plan staged into the regions: (request ids, rows of each, rows in all); None: none, or
        # forgotten (adapters or requests changed, or an idle step overwrote the regions).
        self._staged: tuple[list[str], list[int], int] | None = None
        self._token_slots: StagedRegion | None = None
        self._block_tokens: StagedRegion | None = None
        self._block_slot: StagedRegion | None = None

    @property
    def num_adapters(self) -> int:
        return len(self._rows)

    # ------------------------------------------------------------------ adapters (between steps)
    def add(self, adapter: LoRAAdapter) -> None:
        """Read, check and pack `adapter` into a host row (`LoRAError` names what does not fit this model)."""
        if adapter.lora_id in self._rows:
            raise LoRAError(f"LoRA adapter id {adapter.lora_id} ({adapter.name!r}) is already loaded")
        peft = read_peft_adapter(adapter.path, self.max_lora_rank)
        row = pack_adapter(
            self.layout, peft.tensors, peft.scaling, self.arch, self.model, self.rank, self.world_size
        ).to(self.pool.dtype)
        self._rows[adapter.lora_id] = row.pin_memory() if self.pool.device.type == "cuda" else row
        self._staged = None

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (its slot is free for the next; steps already queued still read its old row)."""
        self._rows.pop(lora_id, None)
        self._staged = None
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            del self._recent[lora_id]
            self._free.append(slot)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, lora_id: int) -> None:
        if lora_id not in self._rows:
            raise LoRAError(f"request {request_id!r} names LoRA adapter id {lora_id}, which is not loaded")
        self._request_lora[request_id] = lora_id
        self._staged = None

    def remove_request(self, request_id: str) -> None:
        if self._request_lora.pop(request_id, None) is not None:
            self._staged = None

    # ------------------------------------------------------------------ the step
    def bind(self, staging: StepStaging, max_num_tokens: int) -> None:
        """Declare the step's fixed regions (before the staging's first use) and point the layers at them."""
        batch = self.batch
        if batch.kernels:
            blocks = max_lora_blocks(max_num_tokens, self.num_slots)
            self._block_tokens = staging.region(blocks * LORA_BLOCK_M, torch.int32)
            self._block_slot = staging.region(blocks, torch.int32)
            batch.block_tokens, batch.block_slot = self._block_tokens.dev, self._block_slot.dev
        else:
            self._token_slots = staging.region(max_num_tokens, torch.int32)
            batch.token_slots = self._token_slots.dev

    def stage(self, scheduled: SchedulerOutput, num_tokens: int, query_lens: Sequence[int]) -> None:
        """The step's rows per slot, into their regions (sent by the step's flush), adapters it uses loaded
        into slots first; `num_tokens`: the step's rows, padding included; `query_lens`: each sequence's rows
        in order (entries past the sequences', a bucket's padding, are ignored).

        A step of the same sequences with the same rows as the last staged one (most decode steps: the batch
        changes when a request joins or ends) stages nothing: its regions, on the host and on the device, still
        hold that plan, and every adapter it uses is still in its slot (anything that could move one is a
        change of adapters or requests, which forgets the plan)."""
        lora_of = self._request_lora
        if not lora_of:
            self.batch.active = False
            return
        request_ids = [s.request_id for s in scheduled.seqs]
        staged = self._staged
        if staged is not None and staged[2] == num_tokens and staged[0] == request_ids and staged[1] == query_lens:
            self.batch.active = True
            return
        ids = [lora_of.get(r, 0) for r in request_ids]
        needed = set(ids)
        needed.discard(0)
        if not needed:
            self.batch.active = False
            return
        slot_of = self._place(sorted(needed))
        slot_of[0] = -1
        self._stage_rows([slot_of[i] for i in ids], query_lens, num_tokens)
        self._staged = (request_ids, list(query_lens), num_tokens)
        self.batch.active = True

    def stage_idle(self, num_tokens: int, active: bool) -> None:
        """A step of `num_tokens` rows with no adapter row, the layers `active` or not (graph capture)."""
        if active:
            self._stage_rows([], [], num_tokens)
            self._staged = None
        self.batch.active = active

    def compile_kernels(self) -> None:
        """Launch every kind of LoRA layer's kernels once with no adapter row (block tables of their own), on
        each path, so the first adapter step of an engine without CUDA graphs compiles nothing (capture does it
        otherwise)."""
        if not self.batch.kernels:
            return
        device, dtype, rows = self.pool.device, self.pool.dtype, LORA_BLOCK_M
        blocks = max_lora_blocks(rows, self.num_slots)
        bound = self.batch.block_tokens, self.batch.block_slot
        self.batch.block_tokens = torch.full((blocks * rows,), -1, dtype=torch.int32, device=device)
        self.batch.block_slot = torch.full((blocks,), -1, dtype=torch.int32, device=device)
        try:
            seen: set[tuple[int, tuple[int, ...]]] = set()
            for layer in self.model.modules():
                if isinstance(layer, LoRALinear) and (layer.a.shape[2], layer.shard_sizes) not in seen:
                    seen.add((layer.a.shape[2], layer.shard_sizes))
                    x = torch.zeros(rows, layer.a.shape[2], dtype=dtype, device=device)
                    y = torch.zeros(rows, sum(layer.shard_sizes), dtype=dtype, device=device)
                    for path in LORA_PATHS:  # which one a step takes depends on its row count
                        layer.add_adapters(x, y, path)
        finally:
            self.batch.block_tokens, self.batch.block_slot = bound

    def _stage_rows(self, seq_slots: list[int], query_lens: Sequence[int], num_tokens: int) -> None:
        if self.batch.kernels:
            assert self._block_tokens is not None and self._block_slot is not None, "bind() first"
            tokens, slot_of_block = plan_lora_blocks(seq_slots, query_lens, self.num_slots, num_tokens)
            self._block_tokens.put(tokens)
            self._block_slot.put(slot_of_block)
        else:
            assert self._token_slots is not None, "bind() first"
            self._token_slots.put(token_slots(seq_slots, query_lens, num_tokens))

    def _place(self, needed: list[int]) -> dict[int, int]:
        """Each adapter of the step (`needed`: their ids, ascending) -> its slot, loading those not in one (in id
        order: every rank alike)."""
        assert len(needed) <= self.num_slots, "the core runs at most max_loras adapters at once"
        recent, slot_of = self._recent, self._slot_of
        for lora_id in needed:
            if lora_id in slot_of:
                recent.move_to_end(lora_id)
        for lora_id in needed:
            if lora_id in slot_of:
                continue
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(v for v in recent if v not in needed)  # exists: needed fits the slots
                slot = slot_of.pop(victim)
                del recent[victim]
            self.pool[slot].copy_(self._rows[lora_id], non_blocking=True)
            slot_of[lora_id] = slot
            recent[lora_id] = None
        return {lora_id: slot_of[lora_id] for lora_id in needed}
