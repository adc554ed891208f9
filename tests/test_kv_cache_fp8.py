"""`kv_cache_dtype="fp8"` through the whole engine on CPU (the torch reference backend, float32 activations):
log-probabilities within e4m3's tolerance of the model-dtype cache; the same greedy tokens under chunked prefill,
preemption and prefix hits as without them; twice the blocks of a bfloat16 cache in the same memory; a
checkpoint's k_scale / v_scale on its layers, changing the outputs as they should; bad values refused by name.

The tolerance: e4m3 keeps 3 mantissa bits, so each stored key and value is within 2**-4 of itself (round to
nearest). The attention outputs, and through the tiny models' 2-4 layers the last hidden state, move by about that
fraction, each attention layer adding its own: up to 2 * 2**-4 of their size; a log-probability, a difference of
two logits, by twice that fraction of the largest logit. Hence `|logprob - logprob(auto)| <= 4 * 2**-4 *
max|logit|` at every position (transformers' float32 logits give max|logit|), and 2**-4 * max|logit| on average;
measured worst cases are 0.05-0.15 * max|logit| across the families.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidConfigError, UnsupportedModelError
from asyncllm.kernels.kv_cache_fp8_ref import quantize_kv, read_kv
from tests.fixtures.kv_scales import NAMINGS, with_kv_scales

ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256)
E4M3_STEP = 2**-4  # e4m3's largest relative rounding error


def make_prompts(seed: int = 0, lengths: tuple[int, ...] = (40, 70, 25)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def _prompt_logprobs(path: Path, prompts: list[list[int]], **engine_args: Any) -> list[float]:
    """Each prompt token's log-probability after the first, teacher-forced (every engine scores the same tokens)."""
    llm = LLM(str(path), **{**ENGINE, **engine_args})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.shutdown()
    found = []
    for out, ids in zip(outs, prompts):
        assert out.prompt_logprobs is not None
        for token, scored in zip(ids[1:], out.prompt_logprobs[1:]):
            assert scored is not None
            found.append(float(getattr(scored[token], "logprob", scored[token])))
    return found


def largest_logit(path: Path, prompts: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        return max(model(torch.tensor([ids])).logits.abs().max().item() for ids in prompts)


def assert_within_e4m3(fp8: list[float], auto: list[float], max_logit: float) -> None:
    diffs = [abs(a - b) for a, b in zip(fp8, auto)]
    assert max(diffs) <= 4 * E4M3_STEP * max_logit, f"worst {max(diffs):.3f}, largest logit {max_logit:.2f}"
    assert sum(diffs) / len(diffs) <= E4M3_STEP * max_logit, f"mean {sum(diffs) / len(diffs):.3f}"


class _RoundingBackend(TorchAttentionBackend):
    """The FP8 cache's maths spelled out over a float32 cache: keys and values stored as their e4m3 codes times
    the scales."""

    def write_kv(self, k, v, k_cache, v_cache, meta, k_scale=None, v_scale=None) -> None:
        k, v = read_kv(quantize_kv(k, k_scale), k_scale), read_kv(quantize_kv(v, v_scale), v_scale)
        super().write_kv(k, v, k_cache, v_cache, meta)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_the_fp8_cache_is_the_model_with_keys_and_values_rounded_to_e4m3(family: str, tiny_checkpoints) -> None:
    """Logits over an e4m3 cache equal, bit for bit, those of the model storing its keys and values rounded to
    e4m3 in a float32 cache: the cache changes nothing else. Chunked steps, non-unit scales."""
    from asyncllm.model_loader.checkpoint import open_checkpoint
    from asyncllm.models.config import ModelArchConfig
    from asyncllm.models.registry import resolve_model_class
    from tests.fixtures.paged import PagedBatcher

    checkpoint = open_checkpoint(str(tiny_checkpoints[family]), torch.float32)
    arch = ModelArchConfig.from_hf(checkpoint.hf_config, None)
    ids = torch.tensor(make_prompts(lengths=(37,))[0])
    logits = []
    for backend, cache_dtype in ((TorchAttentionBackend(), torch.float8_e4m3fn), (_RoundingBackend(), torch.float32)):
        model = resolve_model_class(checkpoint.hf_config)(arch, backend)
        model.load_weights(checkpoint.iter_weights())
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.attn.set_kv_scales(0.37 + i, 1.3 / (i + 1))
        batcher = PagedBatcher(num_blocks=16, block_size=4)
        caches = batcher.new_caches(arch.num_layers, arch.num_kv_heads, arch.head_dim, cache_dtype)
        steps = []
        with torch.inference_mode():
            for start, n in ((0, 16), (16, 20), (36, 1)):
                positions, meta = batcher.step([(0, n)])
                steps.append(model.compute_logits(model(ids[start : start + n], positions, caches, meta)))
        logits.append(torch.cat(steps))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_logprobs_within_e4m3_tolerance_of_the_auto_cache(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Qwen3 (q/k norms), Llama (keys as projected) and Gemma 3 (sliding windows, sandwich norms)."""
    path, prompts = tiny_checkpoints[family], make_prompts()
    auto = _prompt_logprobs(path, prompts)
    fp8 = _prompt_logprobs(path, prompts, kv_cache_dtype="fp8")
    assert_within_e4m3(fp8, auto, largest_logit(path, prompts))
    assert fp8 != auto, "the FP8 cache changed nothing: keys and values were not stored as e4m3"
    assert _prompt_logprobs(path, prompts, kv_cache_dtype="fp8_e4m3") == fp8  # the same cache by its format's name


def _greedy_passes(path: Path, passes: int, **engine_args: Any) -> tuple[list[list[int]], dict[str, Any]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 300) for _ in range(13)]
    prompts = [prefix + [rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 17, 9, 30, 3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="fp8", block_size=4, **engine_args)
    try:
        tokens = [o.token_ids for _ in range(passes) for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return tokens, stats


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_chunked_prefill_preemption_and_prefix_hits_keep_the_tokens(family: str, tiny_checkpoints) -> None:
    """The FP8 path against itself: every key is read back from the cache, this step's included, so a prompt
    prefilled in 8-token chunks, recomputed after a preemption or found in the prefix cache attends to the same
    e4m3 codes as one prefilled whole in a roomy cache."""
    path = tiny_checkpoints[family]
    roomy, _ = _greedy_passes(path, 1, num_kv_blocks=256, enable_prefix_caching=False)
    tight, stats = _greedy_passes(path, 2, num_kv_blocks=16, max_num_batched_tokens=8)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0.3
    assert tight == roomy + roomy


def test_block_count_doubles_against_bfloat16(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same memory budget holds twice the blocks: one byte per element instead of two."""
    monkeypatch.setenv("ASYNCLLM_CPU_KVCACHE_SPACE", str(1 / 1024))
    counts = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(tiny_checkpoints["qwen3"]), device="cpu", dtype="bfloat16", kv_cache_dtype=kv)
        counts[kv] = (llm.stats()["num_total_blocks"], llm.runtime.kv_cache_bytes)
        llm.shutdown()
    (auto_blocks, auto_bytes), (fp8_blocks, fp8_bytes) = counts["auto"], counts["fp8"]
    assert fp8_blocks == 2 * auto_blocks and fp8_bytes == auto_bytes <= 2**20


def _load(path: Path, **engine_args: Any) -> torch.nn.Module:
    """The model as an engine's worker loads it (weights converted, scales taken), on CPU in float32."""
    from asyncllm.attention.torch_ref import TorchAttentionBackend
    from asyncllm.model_loader.checkpoint import open_checkpoint
    from asyncllm.model_loader.loader import load_model
    from asyncllm.worker.device import ResolvedModel

    config = EngineConfig.from_kwargs(str(path), **{**ENGINE, **engine_args})
    checkpoint = open_checkpoint(str(path), torch.float32)
    resolved = ResolvedModel.resolve(config, checkpoint.hf_config)
    mc = config.model_config
    return load_model(checkpoint, resolved.arch, TorchAttentionBackend(), resolved.device, resolved.dtype,
                      mc.load_format, mc.seed, None, resolved.quant)  # fmt: skip


def _layer_scales(model: torch.nn.Module) -> list[tuple[float, float]]:
    return [(layer.self_attn.attn.k_scale.item(), layer.self_attn.attn.v_scale.item()) for layer in model.model.layers]


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_checkpoint_scales_reach_the_layers(naming: str, quantized_checkpoints, tiny_checkpoints, tmp_path) -> None:
    """Each naming, in a compressed-tensors FP8 checkpoint (its kv_cache_scheme accepted, the scales taken out
    before the weights are converted) and in an unquantized one."""
    scales = [(0.5, 0.5), (1.75, 1.75)] if naming == "kv_scale" else [(0.5, 0.25), (1.75, 3.0)]
    fp8_weights, _, _ = quantized_checkpoints["fp8-tensor"]
    for source in (fp8_weights, tiny_checkpoints["qwen3"]):
        path = with_kv_scales(source, tmp_path / f"{source.name}-{naming}", scales, naming)
        assert _layer_scales(_load(path)) == scales
    assert _layer_scales(_load(tiny_checkpoints["qwen3"])) == [(1.0, 1.0)] * 2  # none in the checkpoint: 1.0


def test_checkpoint_scales_change_outputs_accordingly(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Scales that are no power of two move the FP8 outputs (other codes) and keep them within e4m3's tolerance
    (read back times the scale); scales far too small saturate every value (outputs far off: the write divides by
    them). A cache in the model's dtype ignores them."""
    base, prompts = tiny_checkpoints["llama"], make_prompts(lengths=(40, 25))
    scaled = with_kv_scales(base, tmp_path / "scaled", [(0.37, 1.3), (2.9, 0.61)])
    tiny = with_kv_scales(base, tmp_path / "tiny", [(1e-3, 1e-3), (1e-3, 1e-3)])
    auto = _prompt_logprobs(base, prompts)
    unit = _prompt_logprobs(base, prompts, kv_cache_dtype="fp8")
    with_scales = _prompt_logprobs(scaled, prompts, kv_cache_dtype="fp8")
    max_logit = largest_logit(base, prompts)
    assert with_scales != unit
    assert_within_e4m3(with_scales, auto, max_logit)
    saturated = _prompt_logprobs(tiny, prompts, kv_cache_dtype="fp8")
    assert max(abs(a - b) for a, b in zip(saturated, auto)) > 4 * E4M3_STEP * max_logit
    assert _prompt_logprobs(scaled, prompts) == auto


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fp8_e5m2", r"kv_cache_dtype='fp8_e5m2' is not supported: e5m2 keeps 2 mantissa bits.*use 'fp8'"),
        ("int8", r"kv_cache_dtype='int8' is invalid: use one of 'auto', 'fp8', 'fp8_e4m3'"),
        ("float16", r"kv_cache_dtype='float16' is invalid"),
    ],
)
def test_bad_kv_cache_dtype_is_refused_naming_the_field(value: str, message: str, tiny_checkpoints) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        LLM(str(tiny_checkpoints["qwen3"]), **{**ENGINE, "kv_cache_dtype": value})


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.tensor([-0.5]), r"model.layers.0.self_attn.k_scale' is -0.5: a KV-cache scale must be finite and > 0"),
        (torch.tensor([float("nan")]), r"is nan: a KV-cache scale must be finite"),
        (torch.tensor([0.5, 0.25]), r"has shape \(2,\).*per-head or per-channel KV scales are not supported"),
        (None, r"checkpoint has model.layers.0.self_attn's v_scale but not its k_scale"),
    ],
)
def test_bad_checkpoint_scales_are_refused_naming_the_tensor(tensor, message, tiny_checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = with_kv_scales(tiny_checkpoints["qwen3"], tmp_path / "bad", [(0.5, 0.5), (0.5, 0.5)])
    tensors = load_file(str(path / "model.safetensors"))
    if tensor is None:
        del tensors["model.layers.0.self_attn.k_scale"]
    else:
        tensors["model.layers.0.self_attn.k_scale"] = tensor
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(str(path), **{**ENGINE, "kv_cache_dtype": "fp8"})


def test_server_flag() -> None:
    from asyncllm.server.cli import build_parser
    from asyncllm.server.engine_flags import engine_arg_specs, engine_args_from

    args = build_parser().parse_args(["/models/m", "--kv-cache-dtype", "fp8"])
    assert engine_args_from(args, engine_arg_specs()) == {"kv_cache_dtype": "fp8"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["/models/m", "--kv-cache-dtype", "fp8_e5m2"])
