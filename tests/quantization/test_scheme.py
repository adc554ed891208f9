"""Reading quantization_config into a scheme: every hub format asyncllm reads, and a refusal naming the field
for each thing it cannot honour; the `quantization` engine argument against the checkpoint."""

from __future__ import annotations

from typing import Any

import pytest

from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidConfigError, UnsupportedModelError
from asyncllm.quantization.scheme import CheckpointFormat, checkpoint_scheme, resolve_quantization

AWQ = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")
GPTQ = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=True)
CT_GROUP = dict(
    targets=["Linear"],
    weights=dict(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="channel"),
    input_activations=dict(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token"),
)
CT = dict(quant_method="compressed-tensors", format="float-quantized", config_groups={"group_0": CT_GROUP},
          ignore=["lm_head", "re:.*mlp\\.gate$"])  # fmt: skip
# An FP8 KV cache's scales, as llm-compressor writes them (one static scale per layer for keys, one for values).
KV = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)


def test_hub_formats_read() -> None:
    awq = checkpoint_scheme(AWQ)
    assert (awq.checkpoint, awq.fp8, awq.bits, awq.group_size, awq.zero_point) == (
        CheckpointFormat.AWQ, False, 4, 128, True,
    )  # fmt: skip
    gptq = checkpoint_scheme({**GPTQ, "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"})
    assert (gptq.checkpoint, gptq.bits, gptq.group_size) == (CheckpointFormat.GPTQ_V2, 8, None)
    ct = checkpoint_scheme(CT)
    assert (ct.fp8, ct.group_size, ct.checkpoint) == (True, None, CheckpointFormat.FP8)
    assert ct.skips("lm_head") and ct.skips("model.layers.3.mlp.gate")
    assert not ct.skips("model.layers.3.mlp.gate_proj") and not ct.skips("lm_head_extra")
    block = checkpoint_scheme(dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128, 128]))
    assert (block.block_rows, block.group_size) == (128, 128)
    fbgemm = checkpoint_scheme(dict(quant_method="fbgemm_fp8", activation_scale_ub=1200.0))
    assert fbgemm.activation_scale_ub == 1200.0 and fbgemm.group_size is None
    assert checkpoint_scheme({**CT, "kv_cache_scheme": KV}) == ct  # the KV cache's scales leave the layers as they are
    awq_skips = checkpoint_scheme({**AWQ, "modules_to_not_convert": ["visual", "mlp.gate"]})
    assert awq_skips.skips("model.layers.0.mlp.gate") and not awq_skips.skips("model.layers.0.self_attn.q_proj")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(quant_method="bitsandbytes"), r"quant_method='bitsandbytes' is not supported; supported: awq, gptq"),
        ({**AWQ, "bits": 3}, r"awq checkpoint: quantization_config.bits=3 is not supported"),
        ({**AWQ, "version": "gemv"}, r"version='gemv' is not supported \(only the GEMM layout"),
        ({**AWQ, "zero_point": False}, r"zero_point=False is not supported"),
        ({**AWQ, "group_size": 0}, r"group_size=0 is not supported"),
        ({**GPTQ, "bits": 3}, r"gptq checkpoint: quantization_config.bits=3 is not supported \(4 or 8\)"),
        ({**GPTQ, "bits": 2}, r"bits=2 is not supported"),
        ({**GPTQ, "group_size": "128"}, r"group_size='128' is not supported"),
        ({**GPTQ, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported"),
        ({**GPTQ, "lm_head": True}, r"lm_head=True is not supported"),
        ({**CT, "format": "pack-quantized"}, r"format='pack-quantized' is not supported"),
        ({**CT, "kv_cache_scheme": {"num_bits": 8}}, r"kv_cache_scheme.type=None is not supported \('float'"),
        ({**CT, "kv_cache_scheme": {**KV, "num_bits": 4}}, r"kv_cache_scheme.num_bits=4 is not supported"),
        ({**CT, "kv_cache_scheme": {**KV, "strategy": "attn_head"}}, r"strategy='attn_head' .*one scale per layer"),
        ({**CT, "kv_cache_scheme": {**KV, "dynamic": True}}, r"kv_cache_scheme.dynamic=True is not supported"),
        (
            {**CT, "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "type": "int"}}}},
            r"config_groups.g.weights \(type, num_bits\)=\('int', 8\) is not supported",
        ),
        (
            {**CT, "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "group"}}}},
            r"weights.strategy='group' is not supported",
        ),
        ({**CT, "config_groups": {"a": CT_GROUP, "b": CT_GROUP}}, r"config_groups=.* is not supported \(exactly one"),
        (dict(quant_method="fp8", fmt="e5m2"), r"fmt='e5m2' is not supported"),
        (dict(quant_method="fp8", weight_block_size=[128]), r"weight_block_size=\[128\] is not supported"),
        (dict(quant_method="fbgemm_fp8", activation_scale_ub=-1), r"activation_scale_ub=-1 is not supported"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        checkpoint_scheme(config)


def test_engine_argument_against_the_checkpoint() -> None:
    assert resolve_quantization(None, None) is None
    at_load = resolve_quantization("fp8", None)
    assert at_load is not None and at_load.checkpoint is CheckpointFormat.FLOAT and at_load.group_size is None
    assert resolve_quantization("awq", AWQ) == resolve_quantization(None, AWQ)
    assert resolve_quantization("fp8", CT) == checkpoint_scheme(CT)
    with pytest.raises(UnsupportedModelError, match=r"quantization='awq' needs a checkpoint quantized with AWQ"):
        resolve_quantization("awq", None)
    with pytest.raises(UnsupportedModelError, match=r"quantization='gptq', but the checkpoint is quantized with awq"):
        resolve_quantization("gptq", AWQ)
    with pytest.raises(UnsupportedModelError, match=r"quantization='awq', but .* compressed-tensors.*'fp8'"):
        resolve_quantization("awq", CT)


def test_quantization_argument_is_validated() -> None:
    assert EngineConfig.from_kwargs("m", quantization="fp8").model_config.quantization.value == "fp8"
    assert EngineConfig.from_kwargs("m").model_config.quantization is None
    with pytest.raises(InvalidConfigError, match=r"quantization='int4' is invalid: use one of 'fp8', 'awq', 'gptq'"):
        EngineConfig.from_kwargs("m", quantization="int4")
