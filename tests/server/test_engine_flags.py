"""Engine arguments become `asyncllm serve` flags by introspecting EngineConfig: every field, typed, with its
docstring as help, booleans as --x/--no-x; flags left out stay out (the engine's defaults apply); a config
composed of smaller dataclasses flattens into the same flags."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import pytest

from asyncllm.cli import build_parser as build_main_parser
from asyncllm.config import EngineConfig
from asyncllm.server.cli import build_parser
from asyncllm.server.engine_flags import engine_arg_specs, engine_args_from


def test_every_engine_argument_is_a_flag() -> None:
    specs = {s.name: s for s in engine_arg_specs()}
    with pytest.raises(TypeError) as info:  # the engine names every argument it knows when refusing one
        EngineConfig.from_kwargs("/models/m", no_such_argument=1)
    assert set(specs) == set(str(info.value).split("known arguments: ")[1].split(", "))
    EngineConfig.from_kwargs("/models/m", **{s.name: s.default for s in specs.values()})  # defaults are accepted
    assert specs["num_kv_blocks"].type is int and specs["num_kv_blocks"].optional
    assert specs["enable_prefix_caching"].type is bool and specs["enable_prefix_caching"].default is True
    assert specs["gpu_memory_utilization"].type is float
    assert specs["device"].choices == ("auto", "cuda", "cpu") and specs["device"].default == "auto"
    assert specs["tokenizer"].type is str
    assert "prefix" in specs["enable_prefix_caching"].help.lower()  # the field's docstring
    assert all(s.help for s in specs.values()), [s.name for s in specs.values() if not s.help]


def test_parsed_flags_are_engine_arguments() -> None:
    argv = ["/models/m", "--tensor-parallel-size", "2", "--num-kv-blocks", "4096", "--no-enable-prefix-caching"]
    args = build_parser().parse_args([*argv, "--device", "cpu", "--gpu-memory-utilization", "0.5", "--port", "9001"])
    engine_args = engine_args_from(args, engine_arg_specs())
    assert engine_args == dict(
        tensor_parallel_size=2,
        num_kv_blocks=4096,
        enable_prefix_caching=False,
        device="cpu",
        gpu_memory_utilization=0.5,
    )
    assert (args.model, args.port, args.host) == ("/models/m", 9001, "127.0.0.1")
    assert engine_args_from(build_parser().parse_args([]), engine_arg_specs()) == {}  # the engine's defaults apply
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--device", "tpu"])


def test_serve_is_a_subcommand_of_asyncllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_API_KEY", "from-env")
    args = build_main_parser().parse_args(["serve", "--max-num-seqs", "8", "--served-model-name", "x"])
    assert (args.command, args.model, args.max_num_seqs, args.served_model_name) == ("serve", None, 8, "x")
    assert args.api_key == "from-env"


@dataclass(frozen=True, kw_only=True)
class _CacheConfig:
    block_size: int = 16
    """Tokens per block."""
    enable_prefix_caching: bool = True
    """Reuse prefixes."""


@dataclass(frozen=True, kw_only=True)
class _ComposedConfig:
    model: str
    """The checkpoint."""
    cache: _CacheConfig = dataclasses.field(default_factory=_CacheConfig)
    """Cache settings."""
    seed: int | None = None
    """Seed."""


class _Mode(str, enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclass(frozen=True, kw_only=True)
class _DocumentedPart:
    mode: _Mode = dataclasses.field(default=_Mode.FAST, metadata={"doc": "How to run."})
    limit: int | None = dataclasses.field(default=None, metadata={"doc": "At most this many."})


@dataclass(frozen=True)
class _PartsConfig:
    model_part: _CacheConfig
    other_part: _DocumentedPart = dataclasses.field(default_factory=_DocumentedPart)


def test_composed_config_flattens_into_flags() -> None:
    """If EngineConfig becomes a composition of small configs, their fields stay flags of their own, with
    their docs written as docstrings or as field metadata."""
    specs = engine_arg_specs(_ComposedConfig)
    assert [(s.name, s.type, s.help, s.optional) for s in specs] == [
        ("block_size", int, "Tokens per block.", False),
        ("enable_prefix_caching", bool, "Reuse prefixes.", False),
        ("seed", int, "Seed.", True),
    ]
    specs = engine_arg_specs(_PartsConfig)
    assert [(s.name, s.type, s.help, s.choices, s.default) for s in specs] == [
        ("block_size", int, "Tokens per block.", None, 16),
        ("enable_prefix_caching", bool, "Reuse prefixes.", None, True),
        ("mode", str, "How to run.", ("fast", "slow"), "fast"),
        ("limit", int, "At most this many.", None, None),
    ]
