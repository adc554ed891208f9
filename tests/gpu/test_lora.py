"""LoRA on the GPU: the batched Triton kernels replayed in CUDA graphs give the torch reference's tokens (float32,
IEEE matmuls) for a batch mixing three adapters and the base across every captured size, with one slot fewer
than adapters (slots reloaded between steps) and preemption; float32 graphs equal the merged model; and
bfloat16 graphs equal bfloat16 eager (the same kernels outside graphs). The adapters are written without PEFT
(the GPU machine has none), in its format."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.fixtures.lora_adapters import merged_greedy, write_adapter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NAMES = ("a", "b", "c", None)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-lora")
    return {name: write_adapter(root / name, tiny_model, seed, r=4 + 2 * seed) for seed, name in enumerate("abc")}


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(37)]
    params = [SamplingParams(temperature=0, max_tokens=4 + i % 9, ignore_eos=True) for i in range(37)]
    return prompts, params, [NAMES[i % 4] for i in range(37)]


def _run(path: Path, adapters: dict[str, Path], **args: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", block_size=4, max_num_seqs=40, enable_lora=True, max_lora_rank=8, **args)
    try:
        for name in NAMES[:3]:
            llm.add_lora(name, adapters[name])
        prompts, params, loras = _workload(llm.runtime.vocab_size)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora=loras)]
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("exact_fp32")
@pytest.mark.parametrize("engine_args", [dict(num_kv_blocks=512), dict(num_kv_blocks=60, max_num_batched_tokens=64)])
def test_graphs_with_kernels_equal_the_torch_reference(tiny_model, adapters, engine_args: dict) -> None:
    common = dict(dtype="float32", max_loras=2, **engine_args)
    graphs = _run(tiny_model, adapters, attention_backend="triton", **common)
    assert graphs == _run(tiny_model, adapters, attention_backend="torch", **common)


@pytest.mark.usefixtures("exact_fp32")
def test_graphs_equal_the_merged_model(tiny_model: Path, adapters) -> None:
    llm = LLM(str(tiny_model), device="cuda", dtype="float32", block_size=4, enable_lora=True, max_lora_rank=8)
    try:
        llm.add_lora("c", adapters["c"])
        prompt = [17, 4, 250, 99, 8, 61, 120]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora="c")
        assert out[0].token_ids == merged_greedy(tiny_model, adapters["c"], [prompt], 12, peft=False)[0]
    finally:
        llm.shutdown()


def test_bf16_graphs_equal_eager(tiny_model: Path, adapters) -> None:
    common = dict(dtype="bfloat16", max_loras=4, num_kv_blocks=512)
    graphs = _run(tiny_model, adapters, **common)
    assert graphs == _run(tiny_model, adapters, enforce_eager=True, **common)


def test_serving_compiles_no_lora_kernel_after_warm_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm-up (capture, and the LoRA kernels' own compile step at 16 rows) compiled every LoRA kernel variant
    serving launches: on a model wide enough that prompt steps too large for the graphs give a fused program
    several column tiles (gate/up 2 x 2,048 at rank 16), so the programs per shard change with the row count;
    both are run-time arguments, never a new variant. A compile mid-serving stalls every stream."""
    import triton.knobs

    from tests.fixtures.tiny_models import build_checkpoint

    wide = dict(hidden_size=1024, intermediate_size=2048, max_position_embeddings=2048)
    model = build_checkpoint(tmp_path / "wide", "qwen3", **wide)
    adapters = {name: write_adapter(tmp_path / name, model, seed, r=8) for seed, name in enumerate("ab")}
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_MAX_TOKENS", "64")
    llm = LLM(
        str(model), device="cuda", dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=8,
        max_num_batched_tokens=1024, num_kv_blocks=1024, block_size=16,
    )  # fmt: skip
    try:
        for name, path in adapters.items():
            llm.add_lora(name, path)
        rng = random.Random(9)
        vocab = llm.runtime.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1000, 700, 300, 90, 40, 5)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        compiled: list[str] = []
        previous = triton.knobs.runtime.jit_post_compile_hook

        def hook(**kwargs) -> bool:
            compiled.append(str(kwargs.get("repr", "?")))
            return False

        triton.knobs.runtime.jit_post_compile_hook = hook
        try:
            outs = llm.generate(prompts, params, use_tqdm=False, lora=["a", "b", None, "a", "b", "a"])
        finally:
            triton.knobs.runtime.jit_post_compile_hook = previous
        assert all(len(o.token_ids) == 6 for o in outs)
        assert not compiled, f"{len(compiled)} Triton compilations after warm-up: {compiled[:5]}"
    finally:
        llm.shutdown()
