"""`LoRAManager`'s staging, step by step: after every step each row the device sees names the slot that holds
its request's adapter (the slot's pool row is that adapter, packed independently here), or none, in both
forms (the kernels' block tables, the torch form's row slots). Most steps repeat the last one's batch and
stage nothing new; the steps here change one thing at a time (an idle step of graph capture in between, the
rows of a sequence, a request ending, adapters evicted from the slots, an adapter removed and another added)
and must each be staged anew."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.kernels.lora_plan import max_lora_blocks
from asyncllm.layers.lora import LoRALinear
from asyncllm.model_loader.lora import read_peft_adapter
from asyncllm.models.lora import pack_adapter
from asyncllm.step import LoRAAdapter, ScheduledSeq, SchedulerOutput
from asyncllm.worker.lora import LoRAManager
from asyncllm.worker.step_staging import StepStaging
from tests.models.helpers import load_ours

MAX_TOKENS = 64


def _row_slots(manager: LoRAManager, num_tokens: int) -> list[int]:
    """Each row's slot as the device reads it (after the flush), -1 for none."""
    batch = manager.batch
    if not batch.active:
        return [-1] * num_tokens
    if not batch.kernels:
        assert batch.token_slots is not None
        return batch.token_slots[:num_tokens].tolist()
    assert batch.block_tokens is not None and batch.block_slot is not None
    rows = [-1] * num_tokens
    tokens = batch.block_tokens.tolist()
    grid = max_lora_blocks(num_tokens, manager.num_slots)  # the blocks a launch for these rows reads
    for block, slot in enumerate(batch.block_slot[:grid].tolist()):
        for t in tokens[block * 16 : (block + 1) * 16] if slot >= 0 else ():
            if t >= 0:
                assert rows[t] == -1, "a row in two blocks"
                rows[t] = slot
    return rows


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_every_step_stages_each_rows_adapter(tiny_model: Path, tiny_lora_adapters, kernels: bool) -> None:
    model = load_ours(tiny_model)
    manager = LoRAManager(model, model.arch, max_loras=2, max_lora_rank=8)
    if kernels:  # the block tables (the kernels themselves are not run)
        for layer in model.modules():
            if isinstance(layer, LoRALinear):
                layer.enable_fused_kernels()
    staging = StepStaging(torch.device("cpu"), 4096)
    manager.bind(staging, MAX_TOKENS)
    packed: dict[int, torch.Tensor] = {}
    paths = {1: "a", 2: "b", 3: "c", 4: "a"}

    def add(lora_id: int) -> None:
        path = tiny_lora_adapters[paths[lora_id]]
        manager.add(LoRAAdapter(lora_id, paths[lora_id], str(path)))
        peft = read_peft_adapter(path, 8)
        packed[lora_id] = pack_adapter(manager.layout, peft.tensors, peft.scaling, model.arch, model)

    for lora_id in (1, 2, 3):
        add(lora_id)
    adapter_of = {"r0": 1, "r1": 2, "r2": 0, "r3": 1, "r4": 2, "r5": 0, "r6": 3, "r7": 4}
    for request_id, lora_id in adapter_of.items():
        if lora_id and lora_id != 4:
            manager.add_request(request_id, lora_id)

    def step(request_ids: list[str], lens: list[int] | None = None, pad_to: int = 0) -> None:
        lens = lens or [1] * len(request_ids)
        seqs = [ScheduledSeq(r, [5] * n, 0, [0], sample=True) for r, n in zip(request_ids, lens)]
        num_tokens = max(sum(lens), pad_to)
        manager.stage(SchedulerOutput(seqs=seqs), num_tokens, lens + [1] * (pad_to - sum(lens)))
        staging.flush()
        rows = _row_slots(manager, num_tokens)
        t = 0
        for request_id, n in zip(request_ids, lens):
            lora_id = adapter_of[request_id]
            for slot in rows[t : t + n]:
                if lora_id == 0:
                    assert slot == -1, f"{request_id} has no adapter, its row reads slot {slot}"
                else:
                    assert slot >= 0, f"{request_id}'s row reads no slot"
                    held = manager.pool[slot]
                    assert torch.equal(held, packed[lora_id].to(held.dtype)), f"{request_id}: slot {slot}"
            t += n
        assert rows[t:] == [-1] * (num_tokens - t), "padding rows read a slot"

    batch = ["r0", "r1", "r2", "r3", "r4", "r5"]
    step(batch, pad_to=8)
    step(batch, pad_to=8)  # the same batch again: nothing new to stage
    manager.stage_idle(8, active=True)  # graph capture between two steps overwrites the tables
    staging.flush()
    step(batch, pad_to=8)
    step(batch, [2, 1, 1, 2, 1, 1])  # the same sequences, other rows (as many in all as the padded step)
    manager.remove_request("r1")
    step(["r0", "r2", "r3", "r4", "r5"], pad_to=8)
    manager.add_request("r6", 3)
    step(["r6", "r0"])  # adapter 3 takes the slot of 2 (max_loras=2)
    step(["r4", "r6"])  # 2 back, in the slot of 1
    step(["r0", "r3", "r2"])  # and 1 back
    manager.remove(1)
    add(4)
    manager.add_request("r7", 4)
    step(["r7", "r4", "r2"])
    step(["r2", "r5"])  # no adapter row: the layers stay off
    assert not manager.batch.active
