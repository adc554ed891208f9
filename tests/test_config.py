"""EngineConfig: flat keyword arguments routed to its five parts, defaults, enum coercion, unknown names
(TypeError) and bad values (ValueError naming them), every error an AsyncLLMError."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from asyncllm import envs
from asyncllm.config import (
    DEFAULT_GRAPH_TOKENS,
    STREAMING_PREFILL_CAP,
    DType,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    engine_arguments,
)
from asyncllm.config_values import AttentionBackendName, Device
from asyncllm.errors import AsyncLLMError, InvalidConfigError


def test_defaults_and_coercion(tmp_path: Path) -> None:
    cfg = EngineConfig.from_kwargs(str(tmp_path))
    model, device, cache, sched = cfg.model_config, cfg.device_config, cfg.cache_config, cfg.scheduler_config
    assert cfg.model == model.model == str(tmp_path)
    assert (device.device, model.dtype, device.attention_backend) == (
        Device.AUTO,
        DType.AUTO,
        AttentionBackendName.AUTO,
    )
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, cache.block_size) == (256, 8192, 16)
    assert cache.enable_prefix_caching and cache.num_kv_blocks is None and model.max_model_len is None
    cfg = EngineConfig.from_kwargs(tmp_path, device="cpu", dtype="float32", attention_backend="torch")
    assert cfg.model == str(tmp_path) and isinstance(cfg.model, str)
    assert (cfg.device_config.device, cfg.model_config.dtype, cfg.device_config.attention_backend) == (
        Device.CPU,
        DType.FLOAT32,
        AttentionBackendName.TORCH,
    )
    cfg = EngineConfig(ModelConfig(model="m", tokenizer=tmp_path))  # type: ignore[arg-type]
    assert cfg.model_config.tokenizer == str(tmp_path)
    assert EngineConfig.from_kwargs("m", max_num_seqs=3).scheduler_config == SchedulerConfig(max_num_seqs=3)


def test_every_argument_is_documented_and_routed() -> None:
    """Each engine argument has one owner part, a doc line, and the default that part declares."""
    args = engine_arguments()
    names = [a.name for a in args]
    assert len(names) == len(set(names))
    assert {"model", "device", "dtype", "tensor_parallel_size", "max_model_len", "max_num_seqs"} <= set(names)
    for a in args:
        assert a.doc, f"{a.name} has no documentation"
        if a.name != "model":
            part = getattr(EngineConfig.from_kwargs("m"), a.part)
            assert getattr(getattr(part, a.name), "value", getattr(part, a.name)) == a.default


def test_unknown_argument_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"unknown engine argument 'max_batch_size'.*known arguments: .*max_num_seqs"):
        EngineConfig.from_kwargs("m", max_batch_size=8, max_num_seqs=4)
    with pytest.raises(TypeError, match="'aaa'") as info:
        EngineConfig.from_kwargs("m", zzz=1, aaa=2)  # the first, alphabetically
    assert isinstance(info.value, AsyncLLMError)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device", "tpu"),
        ("dtype", "int8"),
        ("dtype", None),
        ("attention_backend", "flashinfer"),
        ("attention_backend", "flash"),  # regression: accepted (and offered by `serve --help`), refused at start-up
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", 1.5),
        ("max_model_len", 0),
        ("max_model_len", 1.5),
        ("max_num_seqs", 0),
        ("max_num_seqs", True),
        ("max_num_batched_tokens", -1),
        ("max_prefill_tokens_while_decoding", 0),
        ("max_prefill_tokens_while_decoding", 2.5),
        ("max_prefill_tokens_while_decoding", "2048"),
        ("block_size", 0),
        ("block_size", 12),
        ("block_size", "16"),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.01),
        ("gpu_memory_utilization", math.nan),
        ("gpu_memory_utilization", True),
        ("num_kv_blocks", 0),
        ("num_kv_blocks", 2.0),
        ("kv_offloading_size", -1.0),
        ("kv_offloading_size", math.nan),
        ("kv_offloading_size", True),
        ("kv_offloading_size", "2"),
        ("kv_cache_dir", ""),
        ("kv_cache_dir", 3),
        ("task", "generation"),
        ("task", "embedding"),
        ("enable_prefix_caching", 1),
        ("kv_cache_dtype", "fp8_e5m2"),
        ("kv_cache_dtype", "int8"),
        ("kv_cache_dtype", None),
        ("enforce_eager", "no"),
        ("num_threads", 0),
        ("num_threads", 1.5),
        ("num_threads", True),
        ("num_threads", "2"),
        ("seed", 1.0),
        ("seed", None),
        ("tokenizer", 5),
        ("tokenizer", ""),
    ],
)
def test_bad_value_is_a_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}=") as info:
        EngineConfig.from_kwargs("m", **{field: value})
    assert repr(value) in str(info.value)
    assert isinstance(info.value, AsyncLLMError)


@pytest.mark.parametrize("model", ["", None, 3])
def test_bad_model(model: object) -> None:
    with pytest.raises(ValueError, match=r"^model="):
        EngineConfig.from_kwargs(model)  # type: ignore[arg-type]


def test_frozen() -> None:
    cfg = EngineConfig.from_kwargs("m")
    with pytest.raises(AttributeError):
        cfg.scheduler_config.max_num_seqs = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.scheduler_config = SchedulerConfig()  # type: ignore[misc]


def test_entry_points_settle_the_prefill_cap_and_the_graphs_that_cover_it() -> None:
    """Streaming caps the prompt tokens of steps that also decode and graphs the capped steps; offline gives
    prompts the whole budget. What the user chose is kept, and settling twice changes nothing. The graphs'
    bound follows the settled cap unless ASYNCLLM_CUDA_GRAPH_MAX_TOKENS chose it (`chosen`)."""

    def settled(streaming: bool, chosen: int | None = None, **kwargs: object) -> tuple[int | None, int]:
        cfg = EngineConfig.from_kwargs("m", **kwargs).resolved(streaming=streaming)
        assert cfg.resolved(streaming=not streaming) == cfg
        return cfg.scheduler_config.max_prefill_tokens_while_decoding, cfg.graph_max_tokens(chosen)

    assert settled(True) == (STREAMING_PREFILL_CAP, 256 + STREAMING_PREFILL_CAP)
    assert settled(False) == (8192, DEFAULT_GRAPH_TOKENS)  # the whole budget: no cap
    assert settled(True, max_num_seqs=16) == (STREAMING_PREFILL_CAP, 16 + STREAMING_PREFILL_CAP)
    assert settled(True, max_num_batched_tokens=1024) == (STREAMING_PREFILL_CAP, DEFAULT_GRAPH_TOKENS)  # cap off
    assert settled(True, max_prefill_tokens_while_decoding=512) == (512, DEFAULT_GRAPH_TOKENS)
    assert settled(True, max_prefill_tokens_while_decoding=8192) == (8192, DEFAULT_GRAPH_TOKENS)
    assert settled(False, max_prefill_tokens_while_decoding=4000) == (4000, 4256)
    assert settled(True, 0) == (STREAMING_PREFILL_CAP, 0)
    assert settled(True, 64, max_prefill_tokens_while_decoding=512) == (512, 64)
    assert EngineConfig.from_kwargs("m").graph_max_tokens(None) == DEFAULT_GRAPH_TOKENS  # unsettled: offline


@pytest.mark.parametrize(
    "name",
    [
        "decode_gemv",
        "decode_pdl",
        "decode_fold_reduce",
        "cascade_attention",
        "cuda_graph_sampling",
        "cuda_graph_max_tokens",
        "tp_custom_all_reduce",
        "grammar_process",
        "grammar_process_threads",
        "jump_forward",
    ],
)
def test_tuning_knobs_are_not_engine_arguments(name: str) -> None:
    """Issue 38: the tuning knobs left the engine arguments for ASYNCLLM_* variables (docs/tuning.md)."""
    assert name not in {a.name for a in engine_arguments()}
    assert f"ASYNCLLM_{name.upper()}" in {var.name for var in envs.ALL}
    with pytest.raises(TypeError, match=f"unknown engine argument {name!r}"):
        EngineConfig.from_kwargs("m", **{name: None})


def test_docs_api_table_lists_every_engine_argument() -> None:
    """docs/API.md's argument table and the engine's arguments (also `serve --help`'s flags) are one list."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "API.md").read_text()
    start = doc.index("| argument | default | what |")
    rows = []
    for line in doc[start:].splitlines()[2:]:
        if not line.startswith("| `"):
            break
        rows.append(line.split("|")[1].strip(" `"))
    assert sorted(rows) == sorted(a.name for a in engine_arguments() if a.name != "model")


def test_at_most_30_engine_arguments() -> None:
    """The user's surface stays small (besides the model, what `serve --help` and docs/API.md's table list):
    tuning knobs are ASYNCLLM_* variables (docs/tuning.md), not arguments."""
    names = [a.name for a in engine_arguments() if a.name != "model"]
    assert len(names) <= 30, names


@pytest.mark.parametrize(
    ("name", "variable", "raw", "field", "value"),
    [
        ("async_scheduling", "ASYNCLLM_ASYNC_SCHEDULING", "0", "scheduler_config", False),
        ("max_step_seconds", "ASYNCLLM_MAX_STEP_SECONDS", "2.5", "device_config", 2.5),
        ("cpu_kv_cache_gib", "ASYNCLLM_CPU_KVCACHE_SPACE", "0.5", "cache_config", 0.5),
    ],
)
def test_wave_four_moved_three_arguments_to_variables(
    monkeypatch: pytest.MonkeyPatch, name: str, variable: str, raw: str, field: str, value: object
) -> None:
    """`task`, `kv_offloading_size` and `kv_cache_dir` joined under the cap; a twin switch and two bounds left
    for ASYNCLLM_* variables, read when a config is made. Their old names point at the variable."""
    with pytest.raises(TypeError, match=f"unknown engine argument {name!r}: it is the environment variable {variable}"):
        EngineConfig.from_kwargs("m", **{name: value})
    monkeypatch.setenv(variable, raw)
    assert getattr(getattr(EngineConfig.from_kwargs("m"), field), name) == value
    monkeypatch.setenv(variable, "-1")
    with pytest.raises(InvalidConfigError, match=variable):
        EngineConfig.from_kwargs("m")


def test_task_and_kv_tiers_are_engine_arguments(tmp_path: Path) -> None:
    config = EngineConfig.from_kwargs("m", task="embed", kv_offloading_size=1.5, kv_cache_dir=str(tmp_path / "kv"))
    assert config.model_config.task == "embed" and config.cache_config.kv_offloading_size == 1.5
    assert Path(config.cache_config.kv_cache_dir or "").is_dir()  # made at construction
    assert EngineConfig.from_kwargs("m").cache_config.kv_offloading_size == 0.0  # off by default


def test_a_kv_cache_dir_that_is_a_file_or_unwritable_fails_at_construction(tmp_path: Path) -> None:
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(InvalidConfigError, match=r"kv_cache_dir=.* is a file, not a directory"):
        EngineConfig.from_kwargs("m", kv_cache_dir=str(afile))
    with pytest.raises(InvalidConfigError, match=r"kv_cache_dir=.* cannot be created"):
        EngineConfig.from_kwargs("m", kv_cache_dir=str(afile / "below"))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere
        pytest.skip("this user writes every directory")
    with pytest.raises(InvalidConfigError, match=r"kv_cache_dir=.* is not writable"):
        EngineConfig.from_kwargs("m", kv_cache_dir=str(locked))


def test_kv_tiers_without_the_prefix_cache_fail_at_construction(tmp_path: Path) -> None:
    """The tiers keep the prefix cache's evicted blocks: without the cache there is nothing to keep."""
    with pytest.raises(InvalidConfigError, match=r"kv_offloading_size=2.0 keeps .* needs enable_prefix_caching=True"):
        EngineConfig.from_kwargs("m", kv_offloading_size=2, enable_prefix_caching=False)
    with pytest.raises(InvalidConfigError, match=r"kv_cache_dir=.* needs enable_prefix_caching=True"):
        EngineConfig.from_kwargs("m", kv_cache_dir=str(tmp_path), enable_prefix_caching=False)
    EngineConfig.from_kwargs("m", enable_prefix_caching=False)  # off and off: fine
