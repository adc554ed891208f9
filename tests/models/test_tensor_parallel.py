"""Sharding the Llama family from outside, with ranks as threads (no processes): every family's sharded
worker samples the same greedy tokens as the whole model, with log-probabilities within float32 rounding,
at 2 and 4 ranks and with KV heads replicated; each rank reads only its slice of a safetensors file (a GGUF
file's tensors are sliced once dequantized); sizes that do not divide are refused naming the field."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidConfigError
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.model_loader.safetensors import iter_safetensors
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.tensor_parallel import check_tensor_parallel, weight_shard
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import ModelRunnerOutput, NewRequestData, ScheduledSeq, SchedulerOutput
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.setup import build_worker
from tests.fixtures.thread_group import ThreadGroup, run_ranks
from tests.fixtures.tiny_gguf import build_hf_model, write_gguf
from tests.fixtures.tiny_models import build_checkpoint


def _run_steps(path: Path, group: ThreadGroup | None) -> list[ModelRunnerOutput]:
    """A prefill of three prompts, then four decode steps, on one rank's worker."""
    config = EngineConfig.from_kwargs(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    checkpoint = open_checkpoint(str(path), torch.float32)
    worker = build_worker(config, checkpoint, ResolvedModel.resolve(config, checkpoint.hf_config), group)
    assert worker.runner is not None
    rng = random.Random(0)
    vocab = checkpoint.hf_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 9)]
    params = SamplingParams(temperature=0, logprobs=5)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    step = SchedulerOutput(
        seqs=[ScheduledSeq(f"r{i}", p, 0, tables[i], True) for i, p in enumerate(prompts)],
        new_requests=[NewRequestData(f"r{i}", p, params, i) for i, p in enumerate(prompts)],
    )
    outs = [worker.runner.execute_model(step)]
    for k in range(4):
        last = outs[-1].sampled_token_ids
        seqs = [ScheduledSeq(f"r{i}", [last[i]], len(p) + k, tables[i], True) for i, p in enumerate(prompts)]
        outs.append(worker.runner.execute_model(SchedulerOutput(seqs=seqs)))
    return outs


@pytest.mark.parametrize(("world", "kv_heads"), [(2, None), (4, None), (2, 1)])
def test_sharded_worker_matches_the_whole_model(
    family: str, world: int, kv_heads: int | None, tmp_path_factory: pytest.TempPathFactory, tiny_checkpoints
) -> None:
    """Every rank samples the whole model's greedy tokens, log-probabilities within 1e-4: KV heads split over
    2 and 4 ranks, or one KV head replicated on 2."""
    if kv_heads is None:
        path = tiny_checkpoints[family]
    else:  # fewer KV heads than ranks: each rank holds a replica of its group's head
        path = build_checkpoint(tmp_path_factory.mktemp("kv1") / family, family, num_key_value_heads=kv_heads)
    _check_ranks_match(path, world)


def _check_ranks_match(path: Path, world: int) -> None:
    ref = _run_steps(path, None)
    for rank_outs in run_ranks(world, lambda group: _run_steps(path, group)):
        for want, got in zip(ref, rank_outs):
            assert got.sampled_token_ids == want.sampled_token_ids
            assert want.logprobs is not None and got.logprobs is not None
            for w, g in zip(want.logprobs, got.logprobs):
                assert w is not None and g is not None
                for token, logprob in w.items():
                    assert abs(g[token] - logprob) < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])  # Qwen3-MoE: every expert of a projection stacked
def test_gguf_tensors_are_sliced_after_dequantizing(tmp_path: Path, family: str) -> None:
    """GGUF cannot read a slice from disk: whole tensors are dequantized, then each rank keeps its slice."""
    path = write_gguf(tmp_path / f"{family}.gguf", family, build_hf_model(family, seed=3))
    _check_ranks_match(path, 2)


def test_each_rank_reads_only_its_slices(tiny_checkpoints) -> None:
    """`iter_safetensors` with a selector returns each tensor's shard, as slicing the whole tensor would."""
    path = tiny_checkpoints["qwen2"]  # q/k/v biases, an untied head
    arch = ModelArchConfig.from_hf(open_checkpoint(str(path), torch.float32).hf_config, None)
    whole = dict(iter_safetensors(path, torch.float32))
    for rank in range(2):
        shards = dict(iter_safetensors(path, torch.float32, lambda name, rank=rank: weight_shard(name, arch, rank, 2)))
        assert shards.keys() == whole.keys()
        for name, tensor in whole.items():
            shard = weight_shard(name, arch, rank, 2)
            assert torch.equal(shards[name], tensor if shard is None else shard.take(tensor)), name
        assert shards["model.layers.0.self_attn.o_proj.weight"].shape == (64, 32)  # input columns split
        assert shards["model.layers.0.self_attn.k_proj.bias"].shape == (16,)  # one of two KV heads


def _arch(**overrides: int) -> ModelArchConfig:
    base = dict(vocab_size=10, hidden_size=8, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2)
    base.update(intermediate_size=12, max_position_embeddings=16, max_model_len=16, **overrides)
    return ModelArchConfig("LlamaForCausalLM", rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                           tie_word_embeddings=False, attention_bias=False, mlp_bias=False, **base)  # fmt: skip


def test_sizes_that_do_not_divide_are_refused() -> None:
    check_tensor_parallel(_arch(), 4)  # 2 KV heads over 4 ranks: replicated
    with pytest.raises(InvalidConfigError, match="tensor_parallel_size=3 does not divide the model's 4 attention"):
        check_tensor_parallel(_arch(), 3)
    with pytest.raises(InvalidConfigError, match="6 KV heads"):
        check_tensor_parallel(_arch(num_heads=12, num_kv_heads=6), 4)
    with pytest.raises(InvalidConfigError, match="intermediate_size=12"):
        check_tensor_parallel(_arch(num_heads=8, num_kv_heads=8), 8)
