"""LoRA adapters end to end through `LLM`, against the PEFT-merged transformers model (float32, greedy).

Each adapter made with PEFT (every module, or q/v only with rsLoRA's scaling) gives the merged model's tokens;
two adapters and the base in one batch each give their own; so they do with one slot only (adapters swapped
in and out between steps), through the Triton kernels (Triton's interpreter on CPU), and after a prefix the
base computed first (no prefix hit across adapters). Adapters a model cannot serve are refused, naming why.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.errors import InvalidConfigError, InvalidRequestError, LoRAError
from tests.fixtures.lora_adapters import build_adapter, merged_greedy, with_config
from tests.fixtures.triton_kernels import HAS_CUDA

ARGS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, enable_lora=True, max_lora_rank=8)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 13, 22)]


@pytest.fixture(scope="module")
def merged(tiny_model: Path, tiny_lora_adapters: dict[str, Path], prompts: list[list[int]]) -> dict[str | None, list]:
    """Greedy tokens of the merged models ("a", "b") and of the base (None), for every prompt."""
    out: dict[str | None, list] = {None: merged_greedy(tiny_model, None, prompts, MAX_TOKENS)}
    for name in ("a", "b"):
        out[name] = merged_greedy(tiny_model, tiny_lora_adapters[name], prompts, MAX_TOKENS)
    assert out["a"] != out[None] and out["b"] != out[None], "the adapters must change the tokens"
    return out


def _llm(tiny_model: Path, adapters: dict[str, Path], names: tuple[str, ...] = ("a", "b"), **args) -> LLM:
    llm = LLM(str(tiny_model), **{**ARGS, **args})
    for name in names:
        llm.add_lora(name, adapters[name])
    return llm


def _mixed(llm: LLM, prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """Every prompt through a, b and the base, all in one `generate` (one batch)."""
    names: list[str | None] = ["a", "b", None]
    batch = [(p, name) for name in names for p in prompts]
    outs = llm.generate([p for p, _ in batch], GREEDY, use_tqdm=False, lora=[n for _, n in batch])
    tokens = [o.token_ids for o in outs]
    n = len(prompts)
    return {name: tokens[i * n : (i + 1) * n] for i, name in enumerate(names)}


def test_adapters_and_base_in_one_batch_give_the_merged_models_tokens(
    tiny_model: Path, tiny_lora_adapters: dict[str, Path], prompts, merged
) -> None:
    llm = _llm(tiny_model, tiny_lora_adapters, max_loras=2)
    try:
        assert _mixed(llm, prompts) == merged
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    finally:
        llm.shutdown()


def test_one_slot_swaps_adapters_between_steps(tiny_model: Path, tiny_lora_adapters, prompts, merged) -> None:
    """max_loras=1: the scheduler runs one adapter at a time, the worker reloads its only slot."""
    llm = _llm(tiny_model, tiny_lora_adapters, max_loras=1)
    try:
        assert _mixed(llm, prompts) == merged
        assert _mixed(llm, prompts) == merged  # again, the slot holding b from the end of the first run
    finally:
        llm.shutdown()


def test_no_prefix_hit_across_adapters(tiny_model: Path, tiny_lora_adapters, prompts, merged) -> None:
    llm = _llm(tiny_model, tiny_lora_adapters, max_loras=2)
    try:
        long = prompts[2]
        assert llm.generate(long, GREEDY, use_tqdm=False)[0].token_ids == merged[None][2]
        assert llm.generate(long, GREEDY, use_tqdm=False, lora="a")[0].token_ids == merged["a"][2]
        assert llm.stats()["prefix_cache_hit_rate"] == 0.0
        assert llm.generate(long, GREEDY, use_tqdm=False, lora="a")[0].token_ids == merged["a"][2]
        assert llm.stats()["prefix_cache_hit_rate"] > 0.0  # within one adapter, hits are welcome
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_triton_kernels_in_the_interpreter(tiny_model: Path, tiny_lora_adapters, prompts, merged) -> None:
    """The batched kernels, their block tables staged with the step and decode steps padded to buckets (one
    prompt each: the interpreter is slow)."""
    if HAS_CUDA:
        pytest.skip("the GPU runs this through tests/gpu")
    llm = _llm(tiny_model, tiny_lora_adapters, max_loras=2, attention_backend="triton")
    try:
        names = ["a", "b", None]
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outs = llm.generate([prompts[0]] * 3, params, use_tqdm=False, lora=names)
        assert [o.token_ids for o in outs] == [merged[name][0][:3] for name in names]
    finally:
        llm.shutdown()


def test_bad_adapters_are_refused_naming_why(tiny_model: Path, tiny_lora_adapters, tmp_path: Path) -> None:
    llm = _llm(tiny_model, tiny_lora_adapters, names=(), max_loras=1, max_lora_rank=4)
    a = tiny_lora_adapters["a"]
    try:
        with pytest.raises(LoRAError, match="rank r=8, above this engine's max_lora_rank=4"):
            llm.add_lora("a", a)
        with pytest.raises(LoRAError, match="uses DoRA"):
            llm.add_lora("dora", with_config(tiny_lora_adapters["b"], tmp_path / "dora", use_dora=True))
        with pytest.raises(LoRAError, match=r"adapter_config\.json is missing"):
            llm.add_lora("none", tmp_path)
        embed = build_adapter(tmp_path / "embed", tiny_model, 4, r=4, target_modules=["embed_tokens"])
        with pytest.raises(LoRAError, match=r"targets model\.embed_tokens: asyncllm applies LoRA to linear layers"):
            llm.add_lora("embed", embed)
        assert llm.list_loras() == []
        llm.add_lora("b", tiny_lora_adapters["b"])
        with pytest.raises(LoRAError, match="named 'b' is already added"):
            llm.add_lora("b", tiny_lora_adapters["b"])
        with pytest.raises(InvalidRequestError, match=r"lora='x' is not an added LoRA adapter \(added: 'b'\)"):
            llm.generate([1, 2, 3], GREEDY, use_tqdm=False, lora="x")
        assert llm.list_loras() == ["b"]
        llm.remove_lora("b")
        assert llm.list_loras() == []
    finally:
        llm.shutdown()


def test_adapters_of_other_models_or_modules_are_refused(tiny_checkpoints, tmp_path: Path) -> None:
    """An adapter trained on another checkpoint (other head_dim) does not fit; nor does LoRA on the LM head."""
    other = build_adapter(tmp_path / "llama3", tiny_checkpoints["llama3"], 5, r=4, target_modules=["q_proj"])
    head = build_adapter(tmp_path / "head", tiny_checkpoints["llama"], 6, r=4, target_modules=["v_proj", "lm_head"])
    llm = LLM(str(tiny_checkpoints["llama"]), **{**ARGS, "max_loras": 1})
    try:
        with pytest.raises(LoRAError, match=r"q_proj has lora_A \(4, 64\) and lora_B \(96, 4\); this model needs"):
            llm.add_lora("llama3", other)
        with pytest.raises(LoRAError, match="targets lm_head: asyncllm applies LoRA to linear layers only, not to"):
            llm.add_lora("head", head)
        assert llm.list_loras() == []
    finally:
        llm.shutdown()


def test_lora_arguments_are_checked_and_off_by_default(tiny_model: Path, tiny_lora_adapters) -> None:
    with pytest.raises(InvalidConfigError, match="max_lora_rank=1000 is invalid"):
        LLM(str(tiny_model), **{**ARGS, "max_lora_rank": 1000})
    with pytest.raises(InvalidConfigError, match="max_loras=0 is invalid"):
        LLM(str(tiny_model), **{**ARGS, "max_loras": 0})
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", num_kv_blocks=64)
    try:
        assert llm.runtime.max_loras == 0
        with pytest.raises(LoRAError, match="built without enable_lora=True"):
            llm.add_lora("a", tiny_lora_adapters["a"])
        with pytest.raises(InvalidRequestError, match="built without enable_lora=True"):
            llm.generate([1, 2, 3], GREEDY, use_tqdm=False, lora="a")
    finally:
        llm.shutdown()
