"""The KV tiers below the device through the whole engine on CPU (tiny random-weight models, greedy, float32):
multi-turn conversations whose histories a small device pool evicts give the tokens of an engine without tiers,
restored from the host tier (`stats()["prefix_cache_host_hit_tokens"]`); a second engine on the same directory
finds them on disk after a restart (`prefix_cache_disk_hit_tokens`), while one on other weights or another KV
dtype finds none; corrupted, truncated and foreign files, and another prefix's under a colliding hash, are
ignored with a warning, the tokens unchanged; two
engines writing one directory at once leave blocks a third reads; FP8 codes and a sliding-window model restore
exactly; tensor parallelism (two ranks on gloo) restores each rank's shard; a size too small for one block is
refused at construction, naming the field."""

from __future__ import annotations

import logging
import random
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash

from asyncllm import LLM, SamplingParams
from asyncllm.core import block_hash
from asyncllm.errors import InvalidConfigError
from tests.fixtures.tiny_models import build_checkpoint

# 40 blocks of 4 tokens hold about one conversation of the four below: every returning turn finds its history
# evicted from the device.
ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=64)
HOST = 0.01  # GiB: thousands of the tiny models' blocks
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def converse(path: Path, turns: int = 3, seed: int = 0, **engine: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Four conversations of `turns` turns (each turn: the history so far plus ten new tokens); every turn's
    tokens, and the engine's stats after shutdown (the disk tier's writes are finished then)."""
    llm = LLM(str(path), **{**ENGINE, **engine})
    rng = random.Random(seed)
    histories = [[rng.randrange(3, 300) for _ in range(30)] for _ in range(4)]
    tokens = []
    try:
        for _ in range(turns):
            prompts = [h + [rng.randrange(3, 300) for _ in range(10)] for h in histories]
            for i, out in enumerate(llm.generate(prompts, GREEDY, use_tqdm=False)):
                histories[i] = prompts[i] + list(out.token_ids)
                tokens.append(list(out.token_ids))
        stats = llm.stats()
    finally:
        llm.shutdown()
    return tokens, stats


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["qwen3"]


@pytest.fixture(scope="module")
def without_tiers(qwen3: Path) -> list[list[int]]:
    tokens, stats = converse(qwen3)
    assert stats["prefix_cache_host_hit_tokens"] == stats["prefix_cache_disk_hit_tokens"] == 0
    return tokens


def block_files(directory: Path) -> list[Path]:
    """The disk tier's block files under `kv_cache_dir` (one directory per engine fingerprint)."""
    return sorted(directory.glob("*/*.kvb"))


def test_the_host_tier_restores_evicted_histories_exactly(qwen3: Path, without_tiers: list[list[int]]) -> None:
    tokens, stats = converse(qwen3, kv_offloading_size=HOST)
    assert tokens == without_tiers
    assert stats["prefix_cache_host_hit_tokens"] > 100 and stats["prefix_cache_disk_hit_tokens"] == 0
    assert stats["prefix_cache_hit_tokens"] >= stats["prefix_cache_host_hit_tokens"]


@pytest.mark.parametrize("reader", ["process", "threads"])
def test_a_restart_finds_the_histories_on_disk(
    qwen3: Path, without_tiers: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """Whichever reads the files (ASYNCLLM_KV_DISK_READER: a process of their own, or threads of the engine's)."""
    monkeypatch.setenv("ASYNCLLM_KV_DISK_READER", reader)
    tokens, stats = converse(qwen3, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == without_tiers and stats["prefix_cache_disk_hit_tokens"] == 0
    assert len(block_files(tmp_path)) > 20
    # The same conversations again, in a new engine: the first turn's histories come from disk.
    tokens, stats = converse(qwen3, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == without_tiers and stats["prefix_cache_disk_hit_tokens"] > 100
    # The disk tier works without a host tier of the user's (through a small one of its own).
    tokens, stats = converse(qwen3, kv_cache_dir=str(tmp_path))
    assert tokens == without_tiers and stats["prefix_cache_disk_hit_tokens"] > 100


def test_other_weights_or_kv_dtype_find_nothing(qwen3: Path, tmp_path: Path) -> None:
    converse(qwen3, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path / "cache"))
    other = build_checkpoint(tmp_path / "other", "qwen3", seed=1)  # the same shapes, other weights
    _, stats = converse(other, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path / "cache"))
    assert stats["prefix_cache_disk_hit_tokens"] == 0
    _, stats = converse(qwen3, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path / "cache"), kv_cache_dtype="fp8")
    assert stats["prefix_cache_disk_hit_tokens"] == 0
    assert len({p.parent for p in block_files(tmp_path / "cache")}) == 3  # a directory per fingerprint


def test_corrupted_truncated_and_foreign_files_are_ignored(
    qwen3: Path, without_tiers: list[list[int]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    converse(qwen3, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    files = block_files(tmp_path)
    flipped, truncated, foreign, garbage = files[0:4], files[4:8], files[8:12], files[12:16]
    for path in flipped:  # one payload byte changed
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x40
        path.write_bytes(bytes(data))
    for path in truncated:
        path.write_bytes(path.read_bytes()[:-100])
    for path in foreign:  # a whole, well-formed file of another engine's (its fingerprint differs)
        data = bytearray(path.read_bytes())
        data[8:24] = bytes(16)
        header = bytes(data[:64])
        data[64:72] = struct.pack("<Q", xxhash.xxh3_64_intdigest(header))
        path.write_bytes(bytes(data))
    for path in garbage:
        path.write_bytes(random.Random(0).randbytes(path.stat().st_size))
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        tokens, stats = converse(qwen3, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == without_tiers
    assert stats["prefix_cache_disk_hit_tokens"] > 0  # the intact files still serve
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert any("checksum" in m for m in ignored) and any("truncated" in m for m in ignored), ignored
    assert any("another model" in m for m in ignored) and any("not a KV block file" in m for m in ignored), ignored


def test_another_prefixs_block_under_a_colliding_hash_is_a_miss(
    qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (issue 44 review): a disk hit trusted the 64-bit chained block hash. Prompts that differ from
    the first engine's in their first block are forced onto its hashes: every block the second engine looks up
    has a well-formed file of another prefix's KV. Each is a miss with a warning; the tokens are unchanged."""
    llm_args = {**ENGINE, "kv_offloading_size": HOST, "kv_cache_dir": str(tmp_path)}
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(4)]
    others = [[(t + 7) % 290 + 3 for t in p[:4]] + p[4:] for p in prompts]

    def generate(batch: list[list[int]], **engine: Any) -> tuple[list[list[int]], dict[str, Any]]:
        llm = LLM(str(qwen3), **engine)
        try:
            return [list(o.token_ids) for o in llm.generate(batch, GREEDY, use_tqdm=False)], llm.stats()
        finally:
            llm.shutdown()

    want, _ = generate(others, **ENGINE)
    generate(prompts, **llm_args)
    assert len(block_files(tmp_path)) >= 4 * 9
    collide = {tuple(o[:4]): p[:4] for o, p in zip(others, prompts, strict=True)}
    real = block_hash.hash_block
    monkeypatch.setattr(block_hash, "hash_block", lambda parent, ids: real(parent, collide.get(tuple(ids), ids)))
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        tokens, stats = generate(others, **llm_args)
    assert tokens == want and stats["prefix_cache_disk_hit_tokens"] == 0
    assert any("another prefix" in r.getMessage() for r in caplog.records)


def test_two_engines_writing_one_directory_leave_readable_blocks(
    qwen3: Path, without_tiers: list[list[int]], tmp_path: Path
) -> None:
    results: dict[int, list[list[int]]] = {}

    def run(seed: int) -> None:
        results[seed] = converse(qwen3, seed=seed, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))[0]

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == without_tiers
    for seed in (0, 1):  # each engine's conversations come back from disk in a third engine, unchanged
        tokens, stats = converse(qwen3, seed=seed, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
        assert tokens == results[seed] and stats["prefix_cache_disk_hit_tokens"] > 100
    assert not list(tmp_path.glob("*/*.tmp"))


def test_fp8_codes_restore_exactly(qwen3: Path, tmp_path: Path) -> None:
    want, _ = converse(qwen3, kv_cache_dtype="fp8")
    tokens, stats = converse(qwen3, kv_cache_dtype="fp8", kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == want and stats["prefix_cache_host_hit_tokens"] > 100
    tokens, stats = converse(qwen3, kv_cache_dtype="fp8", kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == want and stats["prefix_cache_disk_hit_tokens"] > 100


def test_a_sliding_window_model_restores_exactly(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["mistral_swa"]
    want, _ = converse(path)
    tokens, stats = converse(path, kv_offloading_size=HOST)
    assert tokens == want and stats["prefix_cache_host_hit_tokens"] > 0


@pytest.mark.slow
def test_tensor_parallel_ranks_restore_their_shards(qwen3: Path, without_tiers: list[list[int]], tmp_path) -> None:
    tokens, stats = converse(qwen3, tensor_parallel_size=2, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == without_tiers and stats["prefix_cache_host_hit_tokens"] > 100
    assert len({p.parent for p in block_files(tmp_path)}) == 2  # each rank's shard, its own fingerprint
    tokens, stats = converse(qwen3, tensor_parallel_size=2, kv_offloading_size=HOST, kv_cache_dir=str(tmp_path))
    assert tokens == without_tiers and stats["prefix_cache_disk_hit_tokens"] > 100


def test_a_host_tier_smaller_than_a_block_is_refused(qwen3: Path) -> None:
    with pytest.raises(InvalidConfigError, match="kv_offloading_size"):
        LLM(str(qwen3), **ENGINE, kv_offloading_size=1e-9)
