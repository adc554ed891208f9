"""`speculative_config`: vLLM's dict (or its JSON, from the command line) validated at construction with a
one-line InvalidConfigError."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from asyncllm.config import EngineConfig, SpeculativeConfig
from asyncllm.errors import InvalidConfigError


def test_a_dict_or_its_json_is_normalised(tmp_path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    for value in (
        spec,
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}',
    ):
        config = EngineConfig.from_kwargs(str(tmp_path), speculative_config=value)
        assert config.scheduler_config.speculative == SpeculativeConfig("ngram", 3, 1, 4)
    assert EngineConfig.from_kwargs(str(tmp_path)).scheduler_config.speculative is None
    defaults = EngineConfig.from_kwargs(
        str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
    assert defaults.scheduler_config.speculative == SpeculativeConfig("ngram", 2, 2, 5)


def test_suffix_takes_vllms_keys_and_defaults(tmp_path: pathlib.Path) -> None:
    """vLLM's suffix_decoding_* keys and defaults (depth 24, 10,000 cached requests, factor 1, probability 0.1);
    the draft length defaults to the depth less one, capped at 16."""
    config = EngineConfig.from_kwargs(str(tmp_path), speculative_config={"method": "suffix"})
    assert config.scheduler_config.speculative == SpeculativeConfig("suffix", 16, 2, 5, 24, 10_000, 1.0, 0.1)
    spec = (
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32, '
        '"suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.5, '
        '"suffix_decoding_min_token_prob": 0.3}'
    )
    config = EngineConfig.from_kwargs(str(tmp_path), speculative_config=spec)
    assert config.scheduler_config.speculative == SpeculativeConfig("suffix", 8, 2, 5, 32, 0, 2.5, 0.3)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, r"speculative_config\['model'\]=None"),
        ({"method": "eagle3", "model": "/no/such/head", "num_speculative_tokens": 2}, "no such head"),
        ({"method": "eagle3", "model": ".", "num_speculative_tokens": 2}, "config.json"),
        (
            {"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "k": 1},
            "unknown key 'k' for method 'eagle3'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config\['model'\]=None"),
        ({"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2}, "no such model"),
        ({"model": "/no/such/draft", "num_speculative_tokens": 2}, "no such model"),  # a draft named alone
        ({"method": "draft_model", "model": ".", "num_speculative_tokens": 2}, "config.json"),
        ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, r"speculative_config\['model'\]=3"),
        ({"method": "suffix", "num_speculative_tokens": 24}, "num_speculative_tokens"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
        ({"method": "suffix", "prompt_lookup_min": 2}, "unknown key 'prompt_lookup_min' for method 'suffix'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 100}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown key 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"method": "suffix", "disable_by_batch_size": 2.5}, "disable_by_batch_size"),
        ("{not json", "JSON"),
        ([1, 2], "dict"),
    ],
)
def test_bad_configs_fail_at_construction(tmp_path, value: object, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message) as info:
        EngineConfig.from_kwargs(str(tmp_path), speculative_config=value)
    assert "\n" not in str(info.value)


def test_speculation_pauses_past_a_batch_size_of_32_unless_told(tmp_path) -> None:
    def spec(**extra: object) -> SpeculativeConfig:
        value = {"method": "ngram", "num_speculative_tokens": 2, **extra}
        config = EngineConfig.from_kwargs(str(tmp_path), speculative_config=value).scheduler_config.speculative
        assert config is not None
        return config

    assert spec().disable_by_batch_size is None and spec().max_speculating_seqs == 32
    assert spec(disable_by_batch_size=4).max_speculating_seqs == 4
    assert spec(disable_by_batch_size=None).max_speculating_seqs == 32


def test_the_command_line_flag_takes_json(tmp_path) -> None:
    from asyncllm.server.engine_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    config = EngineConfig.from_kwargs(str(tmp_path), **vars(ns))
    assert config.scheduler_config.speculative == SpeculativeConfig("ngram", 4, 2, 5)


def _draft_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")  # its contents are checked when the engine builds
    return draft


def test_eagle3_takes_vllms_keys(tmp_path: pathlib.Path) -> None:
    """vLLM's spelling of an EAGLE-3 head: its directory under `model`, as a dict or the command line's JSON."""
    head = str(_draft_dir(tmp_path))
    expected = SpeculativeConfig("eagle3", 3, model=head)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}
    for value in (spec, json.dumps(spec)):
        config = EngineConfig.from_kwargs(str(tmp_path), speculative_config=value)
        assert config.scheduler_config.speculative == expected
        assert expected.runs_model


def test_draft_model_takes_vllms_keys(tmp_path: pathlib.Path) -> None:
    """vLLM's spelling: the draft's path under `model`, `draft_tensor_parallel_size` 1 (the draft runs on the
    target's device); a config naming a model and no method is a draft model's, as in vLLM."""
    draft = str(_draft_dir(tmp_path))
    expected = SpeculativeConfig("draft_model", 3, model=draft)
    for value in (
        {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
        {"model": draft, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
        {"method": "draft_model", "model": pathlib.Path(draft), "num_speculative_tokens": 3},
    ):
        config = EngineConfig.from_kwargs(str(tmp_path), speculative_config=value)
        assert config.scheduler_config.speculative == expected


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"draft_tensor_parallel_size": 2}, r"speculative_config\['draft_tensor_parallel_size'\]=2"),
        ({"draft_tensor_parallel_size": 1.0}, r"speculative_config\['draft_tensor_parallel_size'\]=1.0"),
        ({"draft_tensor_parallel_size": True}, r"speculative_config\['draft_tensor_parallel_size'\]=True"),
        ({"quantization": "fp8"}, "unknown key 'quantization' for method 'draft_model'"),
        ({"prompt_lookup_min": 2}, "unknown key 'prompt_lookup_min'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ],
)
def test_draft_model_bad_keys_fail_naming_them(tmp_path: pathlib.Path, extra: dict, message: str) -> None:
    value = {"method": "draft_model", "model": str(_draft_dir(tmp_path)), "num_speculative_tokens": 2, **extra}
    with pytest.raises(InvalidConfigError, match=message) as info:
        EngineConfig.from_kwargs(str(tmp_path), speculative_config=value)
    assert "\n" not in str(info.value)


def test_the_command_line_flag_takes_a_draft_model(tmp_path: pathlib.Path) -> None:
    from asyncllm.server.engine_flags import add_engine_args

    draft = str(_draft_dir(tmp_path))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    spec = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 5}}'
    ns = parser.parse_args(["--speculative-config", spec])
    config = EngineConfig.from_kwargs(str(tmp_path), **vars(ns))
    assert config.scheduler_config.speculative == SpeculativeConfig("draft_model", 5, model=draft)
