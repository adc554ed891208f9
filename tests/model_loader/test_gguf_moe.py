"""GGUF Qwen3-MoE files (llama.cpp's `qwen3moe`): every expert of a projection stacked in one tensor
(ffn_{gate,up,down}_exps), the router as ffn_gate_inp, the expert counts in metadata. Written here from a
random transformers model, then read back: config, weights in their experts' rows, logits."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from asyncllm.model_loader.checkpoint import open_checkpoint
from tests.fixtures.tiny_gguf import build_hf_model, write_gguf
from tests.models.helpers import assert_logits_close, load_ours, reference_logits, run_schedule


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_gguf_config_and_logits_match_transformers(tmp_path: Path, renormalize: bool) -> None:
    """llama.cpp's Qwen3-MoE renormalises its top-k weights (no key in the file); a file saying
    expert_weights_norm = false does not."""
    hf_model = build_hf_model("qwen3_moe", seed=4, norm_topk_prob=renormalize)
    path = write_gguf(tmp_path / "moe.gguf", "qwen3_moe", hf_model)
    config = open_checkpoint(str(path), torch.float32).hf_config
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.norm_topk_prob is renormalize
    ours = load_ours(path)
    gen = torch.Generator().manual_seed(3)
    seqs = {i: torch.randint(0, ours.arch.vocab_size, (n,), generator=gen) for i, n in enumerate([9, 14])}
    got = run_schedule(ours, seqs, [[(0, 7), (1, 14)], [(0, 1)], [(0, 1)]])
    for seq_id, tokens in seqs.items():
        assert_logits_close(got[seq_id], reference_logits(hf_model, tokens))


def test_quantized_stacked_experts_land_in_their_rows(tmp_path: Path) -> None:
    """Q8_0 experts, dequantized, sit in their expert's gate, up and down rows within Q8_0's rounding."""
    hf_model = build_hf_model("qwen3_moe", seed=5)
    path = write_gguf(tmp_path / "q.gguf", "qwen3_moe", hf_model, quant=gguf.GGMLQuantizationType.Q8_0)
    ours = load_ours(path)
    for i in range(hf_model.config.num_hidden_layers):
        theirs, mine = hf_model.model.layers[i].mlp.experts, ours.model.layers[i].mlp.experts
        for want, got in ((theirs.gate_up_proj, mine.gate_up_proj.weight), (theirs.down_proj, mine.down_proj.weight)):
            err = (got - want).abs().max() / want.abs().max()
            assert 0 < err < 0.01, (i, err.item())  # quantized, and in the right places
