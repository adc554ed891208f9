"""LoRA applied from the weight plan (`models/lora.py`): which layers take adapters, where each checkpoint
module's A and B land in a pool row (their shard's rank rows and output rows, B scaled), and a rank's slice
under tensor parallelism equal to slicing the whole row's pieces as the base weights are sliced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.errors import LoRAError
from asyncllm.models.lora import LoRALayout, pack_adapter, padded_rank
from asyncllm.models.tensor_parallel import shard_arch
from tests.models.helpers import load_ours


def _adapter(model, rank: int = 4, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random A, B for every checkpoint module of layer 0 (q/k/v, o, gate/up, down) of `model`'s shapes."""
    gen = torch.Generator().manual_seed(seed)
    arch = model.arch
    d = arch.head_dim
    shapes = {
        "self_attn.q_proj": (arch.hidden_size, arch.num_heads * d),
        "self_attn.k_proj": (arch.hidden_size, arch.num_kv_heads * d),
        "self_attn.v_proj": (arch.hidden_size, arch.num_kv_heads * d),
        "self_attn.o_proj": (arch.num_heads * d, arch.hidden_size),
        "mlp.gate_proj": (arch.hidden_size, arch.intermediate_size),
        "mlp.up_proj": (arch.hidden_size, arch.intermediate_size),
        "mlp.down_proj": (arch.intermediate_size, arch.hidden_size),
    }
    return {
        f"model.layers.0.{name}": (torch.randn(rank, i, generator=gen), torch.randn(o, rank, generator=gen))
        for name, (i, o) in shapes.items()
    }


def test_targets_and_where_an_adapter_lands(tiny_model: Path) -> None:
    model = load_ours(tiny_model)
    layout = LoRALayout(model, padded_rank(4))
    assert layout.rank == 16
    assert [t.path.removeprefix("model.layers.0.") for t in layout.targets[:4]] == [
        "self_attn.qkv_proj",
        "self_attn.o_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
    ]
    assert len(layout.targets) == 4 * model.arch.num_layers
    qkv, shard = layout.locate("model.layers.0.self_attn.v_proj")
    assert shard == 2 and qkv.names == ("q_proj", "k_proj", "v_proj")
    adapter = _adapter(model)
    row = pack_adapter(layout, adapter, 0.5, model.arch, model)[None]
    a = layout.a_view(row, qkv)[0]  # [3 * 16, in]
    b = layout.b_view(row, qkv)[0]  # [q + k + v, 16]
    a_v, b_v = adapter["model.layers.0.self_attn.v_proj"]
    q, k = qkv.shard_sizes[:2]
    torch.testing.assert_close(a[32:36], a_v)
    assert not a[36:48].any() and not b[:, 4:].any(), "rank padding stays zero"
    torch.testing.assert_close(b[q + k :, :4], b_v * 0.5)
    layer1 = layout.locate("model.layers.1.mlp.down_proj")[0]
    assert not layout.a_view(row, layer1).any(), "modules the adapter leaves out stay zero"


def test_modules_without_lora_support_are_named(tiny_model: Path) -> None:
    model = load_ours(tiny_model)
    layout = LoRALayout(model, 16)
    adapter = _adapter(model)
    adapter["model.layers.0.mlp.experts.3.gate_proj"] = adapter["model.layers.0.mlp.gate_proj"]
    adapter["model.layers.1.mlp.experts.0.gate_proj"] = adapter["model.layers.0.mlp.gate_proj"]
    with pytest.raises(LoRAError, match=r"cannot apply LoRA to: model\.layers\.\*\.mlp\.experts\.\*\.gate_proj; "):
        pack_adapter(layout, adapter, 1.0, model.arch, model)


def test_a_ranks_row_is_its_slice_of_the_whole(tiny_model: Path) -> None:
    """Rank r of 2: q/k/v and gate/up B rows (column-parallel), o and down A columns (row-parallel)."""
    whole_model = load_ours(tiny_model)
    arch = whole_model.arch
    adapter = _adapter(whole_model, seed=3)
    whole = LoRALayout(whole_model, 16)
    full = pack_adapter(whole, adapter, 2.0, arch, whole_model)[None]
    local_model = type(whole_model)(shard_arch(arch, 2), TorchAttentionBackend())
    local = LoRALayout(local_model, 16)
    for rank in range(2):
        row = pack_adapter(local, adapter, 2.0, arch, local_model, rank, 2)[None]
        qkv_w = whole.locate("model.layers.0.self_attn.q_proj")[0]
        qkv_l = local.locate("model.layers.0.self_attn.q_proj")[0]
        b_w, b_l = whole.b_view(full, qkv_w)[0], local.b_view(row, qkv_l)[0]
        q = qkv_w.shard_sizes[0]
        lq, lk = qkv_l.shard_sizes[:2]
        torch.testing.assert_close(b_l[:lq], b_w[rank * lq : (rank + 1) * lq])
        torch.testing.assert_close(b_l[lq : lq + lk], b_w[q + rank * lk : q + (rank + 1) * lk])
        for module in ("o_proj", "down_proj"):
            whole_a = _a(whole, full, module).chunk(2, dim=1)[rank]
            torch.testing.assert_close(_a(local, row, module), whole_a)
        torch.testing.assert_close(_a(local, row, "q_proj"), _a(whole, full, "q_proj"))  # replicated


def _a(layout: LoRALayout, row: torch.Tensor, module: str) -> torch.Tensor:
    """Layer 0's A block holding `module` (all its target's shards)."""
    parent = "self_attn" if module[0] in "qkvo" else "mlp"
    found = layout.locate(f"model.layers.0.{parent}.{module}")
    assert found is not None
    return layout.a_view(row, found[0])[0]
