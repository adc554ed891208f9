"""Quantized checkpoints in the hubs' layouts, loaded by the engine's loader: every layer dequantizes to exactly
the weight the fixture quantized (AWQ's nibble order, GPTQ's zero - 1 and both packing directions, FP8's
per-tensor, per-channel and block scales); what the loader cannot honour is refused naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncllm.errors import UnsupportedModelError
from asyncllm.quantization.packing import awq_unpack, gptq_unpack_columns, gptq_unpack_rows
from tests.fixtures.quantized import VARIANTS, pack_awq, pack_gptq_columns, pack_gptq_rows
from tests.quantization.helpers import dequantized_weights, load_quantized


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dequantized_weights_equal_what_was_quantized(variant: str, quantized_checkpoints) -> None:
    path, _, intended = quantized_checkpoints[variant]
    got = dequantized_weights(load_quantized(path))
    assert set(got) == set(intended)
    for name, weight in intended.items():
        assert torch.equal(got[name], weight), f"{variant}: {name} differs by {(got[name] - weight).abs().max()}"


def test_unpacking_inverts_the_reference_packers() -> None:
    """Each format's unpacking against the fixture's packers (loops after AutoAWQ's and AutoGPTQ's), over
    every code value, with the top code's high bit set (the int32 words are negative)."""
    gen = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        codes = torch.randint(0, 2**bits, (64, 24), generator=gen)
        codes[0, :] = 2**bits - 1
        assert torch.equal(gptq_unpack_rows(pack_gptq_rows(codes, bits), bits), codes)
        assert torch.equal(gptq_unpack_columns(pack_gptq_columns(codes, bits), bits), codes)
    codes = torch.randint(0, 16, (5, 32), generator=gen)
    assert torch.equal(awq_unpack(pack_awq(codes)), codes)
    assert (pack_awq(torch.full((1, 8), 15)) < 0).all()


def _edit(path: Path, out: Path, edit) -> Path:
    """A copy of checkpoint `path` whose tensors `edit(tensors)` changed in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_act_order_g_idx_is_refused(quantized_checkpoints, tmp_path: Path) -> None:
    path, _, _ = quantized_checkpoints["gptq-asym-g32"]
    name = "model.layers.1.mlp.down_proj.g_idx"

    def shuffle(tensors):
        tensors[name] = tensors[name][torch.randperm(tensors[name].numel(), generator=torch.Generator().manual_seed(0))]

    with pytest.raises(UnsupportedModelError, match=r"down_proj.g_idx reorders .*act-order.*desc_act=false"):
        load_quantized(_edit(path, tmp_path / "actorder", shuffle))


def test_float_weight_in_a_quantized_module_is_refused(quantized_checkpoints, tmp_path: Path) -> None:
    path, _, _ = quantized_checkpoints["awq"]
    module = "model.layers.0.self_attn.o_proj"

    def unquantize(tensors):
        for p in ("qweight", "qzeros", "scales"):
            del tensors[f"{module}.{p}"]
        tensors[f"{module}.weight"] = torch.zeros(128, 128)

    with pytest.raises(UnsupportedModelError, match=rf"stores {module}.weight unquantized"):
        load_quantized(_edit(path, tmp_path / "mixed", unquantize))


def test_modules_to_not_convert_load_their_float_weights(quantized_checkpoints, tmp_path: Path) -> None:
    """An AWQ checkpoint leaving the MLP's down projections in float: they load as plain layers, and a packed
    layer split between quantized and not is refused naming both sides."""
    path, deq, _ = quantized_checkpoints["awq"]
    from safetensors.torch import load_file

    floats = load_file(str(deq / "model.safetensors"))

    def keep_float(tensors):
        for name in [n for n in tensors if ".down_proj." in n]:
            del tensors[name]
        tensors.update({n: t for n, t in floats.items() if ".down_proj." in n})

    out = _edit(path, tmp_path / "partial", keep_float)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["down_proj"]
    (out / "config.json").write_text(json.dumps(config))
    got = dequantized_weights(load_quantized(out))
    assert got and not any("down_proj" in n for n in got)
    config["quantization_config"]["modules_to_not_convert"] = ["k_proj"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"leaves \['model.layers.0.self_attn.k_proj'\] unquantized"):
        load_quantized(out)


def test_fp8_refusals(quantized_checkpoints, tmp_path: Path) -> None:
    path, _, _ = quantized_checkpoints["fp8-channel"]
    weight = "model.layers.0.mlp.up_proj.weight"

    def e5m2(tensors):
        tensors[weight] = tensors[weight].float().to(torch.float8_e5m2)

    with pytest.raises(UnsupportedModelError, match=r"up_proj.weight has dtype torch.float8_e5m2"):
        load_quantized(_edit(path, tmp_path / "e5m2", e5m2))

    def fp8_embedding(tensors):
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.float8_e4m3fn)

    with pytest.raises(UnsupportedModelError, match=r"'model.embed_tokens.weight' belongs to a quantized"):
        load_quantized(_edit(path, tmp_path / "embed", fp8_embedding))

    def orphan_scale(tensors):
        del tensors[weight]

    with pytest.raises(UnsupportedModelError, match=r"scales for 'model.layers.0.mlp.up_proj' but no"):
        load_quantized(_edit(path, tmp_path / "orphan", orphan_scale))


def test_fp8_at_load_quantizes_every_linear_per_channel(tiny_checkpoints) -> None:
    """quantization="fp8" on a float checkpoint: e4m3 codes with one scale per output channel, each row's
    largest magnitude mapped to 448, within e4m3's rounding of the float weights."""
    from safetensors.torch import load_file

    path = tiny_checkpoints["qwen3"]
    floats = load_file(str(path / "model.safetensors"))
    got = dequantized_weights(load_quantized(path, "fp8"))
    assert len(got) == 7 * 2
    for name, w in got.items():
        ref = floats[name]
        row_max = ref.abs().amax(1, keepdim=True)
        assert torch.allclose(w.abs().amax(1, keepdim=True), row_max, rtol=1e-6)
        assert ((w - ref).abs() <= row_max / 448 * 16 + 1e-7).all()  # half an e4m3 step (32) at the top binade
