"""GGUF files mixing K-quants, kept quantized: Q4_K, Q5_K and Q6_K tensors (beside Q8_0, as llama.cpp's
Q4_K_M / Q5_K_M files mix them) repacked at load, each layer in its types' layout, dequantizing to exactly
gguf's own dequantization; a packed layer whose shards differ takes the layout holding both; a layer with a
type not kept is dequantized; the engine's tokens equal the dequantized path's; TP cuts on group-16 edges."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from asyncllm import LLM, SamplingParams
from asyncllm.errors import UnsupportedModelError
from asyncllm.layers.parallel import WeightShard
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.quantization.linear import QuantLinear
from asyncllm.quantization.scheme import resolve_quantization
from asyncllm.quantization.sharding import quantized_shards
from tests.fixtures.tiny_gguf import build_hf_model, write_gguf
from tests.fixtures.triton_kernels import HAS_CUDA
from tests.quantization.helpers import dequantized_weights, load_quantized

SIZES = dict(hidden_size=256, intermediate_size=256)  # K-quants' super-blocks are 256 inputs
# Q4_K_M-like: Q4_K, with v and down in Q6_K and o in Q8_0; Q5_K_M-like; and up in F16 (a type not kept).
FILES = {
    "q4_k_m": (Q.Q4_K, {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "attn_output": Q.Q8_0}),
    "q5_k_m": (Q.Q5_K, {"attn_v": Q.Q6_K, "ffn_gate": Q.Q4_1}),
    "f16_up": (Q.Q4_K, {"ffn_up": Q.F16, "attn_k": Q.Q4_0}),
}
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kquants")
    model = build_hf_model("llama", **SIZES)
    return {
        name: write_gguf(root / f"{name}.gguf", "llama", model, quant=quant, types=types)
        for name, (quant, types) in FILES.items()
    }


def _layouts(model: torch.nn.Module) -> dict[str, tuple[int, int, str, torch.dtype]]:
    """{our layer: (bits, group size, offsets, scale dtype)} of layer 0's quantized layers."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and name.startswith("model.layers.0."):
            offsets = "zeros" if m.qzeros is not None else "mins"
            out[name.removeprefix("model.layers.0.")] = (m.bits, m.group_size, offsets, m.scales.dtype)
    return out


@pytest.mark.parametrize("name", sorted(FILES))
def test_kept_weights_equal_gguf_dequantization_bit_for_bit(files, name: str) -> None:
    floats = dict(open_checkpoint(str(files[name]), torch.float32).iter_weights())  # gguf.quants for K types
    model = load_quantized(files[name], "gguf")
    got = dequantized_weights(model)
    assert len(got) == (7 if name != "f16_up" else 5) * 2
    for weight_name, weight in got.items():
        assert torch.equal(weight, floats[weight_name]), weight_name
    f32 = torch.float32
    expected = {
        "q4_k_m": {
            "self_attn.qkv_proj": (8, 16, "mins", f32),  # Q4_K q/k beside Q6_K v: 8-bit codes, groups of 16
            "self_attn.o_proj": (8, 32, "zeros", torch.float16),  # Q8_0 as it is
            "mlp.gate_up_proj": (4, 32, "mins", f32),  # Q4_K
            "mlp.down_proj": (8, 16, "zeros", f32),  # Q6_K
        },
        "q5_k_m": {
            "self_attn.qkv_proj": (8, 16, "mins", f32),  # Q5_K beside Q6_K
            "self_attn.o_proj": (8, 32, "mins", f32),  # Q5_K
            "mlp.gate_up_proj": (8, 32, "mins", f32),  # Q4_1 gate beside Q5_K up
            "mlp.down_proj": (8, 32, "mins", f32),
        },
        "f16_up": {  # gate/up (F16 up) dequantized; Q4_0 k beside Q4_K q/v
            "self_attn.qkv_proj": (4, 32, "mins", f32),
            "self_attn.o_proj": (4, 32, "mins", f32),
            "mlp.down_proj": (4, 32, "mins", f32),
        },
    }[name]
    assert _layouts(model) == expected


def test_engine_tokens_equal_the_dequantized_path(files) -> None:
    prompts = [[5, 9, 2, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for quantization in ("gguf", None):  # None on CPU: dequantized at load
        llm = LLM(str(files["q4_k_m"]), quantization=quantization, **ENGINE)
        outs[quantization] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs["gguf"] == outs[None]


def test_which_types_are_kept(files) -> None:
    """The file's scheme names its kept types; a file with none kept is dequantized, refused if "gguf" is
    asked; CPU dequantizes unless asked."""
    qc = open_checkpoint(str(files["f16_up"]), torch.float32).hf_config.quantization_config
    assert qc["linear_types"] == ["F16", "Q4_0", "Q4_K"]
    assert qc["module_types"]["model.layers.1.mlp.up_proj"] == "F16"
    scheme = resolve_quantization(None, qc, "cuda")
    assert scheme is not None and scheme.method == "gguf Q4_0, Q4_K"
    assert resolve_quantization(None, qc, "cpu") is None
    none_kept = {"quant_method": "gguf", "linear_types": ["Q3_K"], "module_types": {"m.q_proj": "Q3_K"}}
    assert resolve_quantization(None, none_kept, "cuda") is None
    with pytest.raises(UnsupportedModelError, match=r"linear layers are Q3_K; kept quantized are .*Q6_K"):
        resolve_quantization("gguf", none_kept, "cuda")


def test_tensor_parallel_slices_fall_on_group_16_edges(files) -> None:
    """A row-parallel Q6_K layer's inputs 128..256 are words 32..64 of 8-bit codes and groups 8..16 of 16."""
    model = load_quantized(files["q4_k_m"], "gguf")
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down, QuantLinear)
    scheme = resolve_quantization("gguf", open_checkpoint(str(files["q4_k_m"]), torch.float32).hf_config
                                  .quantization_config)  # fmt: skip
    assert scheme is not None
    module = "model.layers.0.mlp.down_proj"
    layer = scheme.layer_scheme([module])
    assert layer is not None
    select = quantized_shards(lambda name: WeightShard(1, 128, 256, 128), {module: layer})
    assert select(f"{module}.qweight") == WeightShard(1, 32, 64, 32)
    assert select(f"{module}.scales") == WeightShard(1, 8, 16, 8)
    assert select(f"{module}.qzeros") == WeightShard(1, 8, 16, 8)


@pytest.mark.slow
def test_tensor_parallel_equals_one_rank(files) -> None:
    prompts = [[5, 9, 2, 7], list(range(3, 30))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(files["q4_k_m"]), quantization="gguf", tensor_parallel_size=tp, **ENGINE)
        outs[tp] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs[1] == outs[2]


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without CUDA (tests/gpu covers the kernels there)")
def test_triton_kernels_equal_the_reference_path_in_the_interpreter(files) -> None:
    """The quantized GEMM (Triton's interpreter) over every layout here: float32 scales, 8-bit codes with mins,
    groups of 16."""
    prompts = [[5, 9, 2, 7, 11, 4]]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(files["q4_k_m"]), quantization="gguf", attention_backend=backend, **ENGINE)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs["triton"] == outs["torch"]
