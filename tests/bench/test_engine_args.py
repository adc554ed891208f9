"""bench/engine_args.py: `--engine-arg` pairs are engine keyword arguments, but a tuning variable's lower-case
name sets its ASYNCLLM_* variable instead (so bench/gpu_check.sh and every script reach the knobs that left the
engine arguments), and `tuning_env` sets and restores them around the engines a script builds."""

from __future__ import annotations

import os

import pytest

from tests.bench.scripts import bench_script


def test_engine_arg_pairs_split_into_kwargs_and_tuning_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ASYNCLLM_CUDA_GRAPH_MAX_TOKENS", "ASYNCLLM_DECODE_PDL"):
        monkeypatch.setenv(name, "")  # recorded, so that what engine_kwargs sets is undone after the test
    with bench_script("engine_args") as engine_args:
        pairs = ["max_num_seqs=8", "cuda_graph_max_tokens=0", "decode_pdl=true", "tokenizer=x"]
        assert engine_args.engine_kwargs(pairs) == {"max_num_seqs": 8, "tokenizer": "x"}
    assert os.environ["ASYNCLLM_CUDA_GRAPH_MAX_TOKENS"] == "0"
    assert os.environ["ASYNCLLM_DECODE_PDL"] == "true"


def test_tuning_env_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "off")
    for name in ("ASYNCLLM_CUDA_GRAPH_SAMPLING", "ASYNCLLM_CASCADE_ATTENTION"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with bench_script("engine_args") as engine_args:
        with engine_args.tuning_env(decode_gemv="on", cuda_graph_sampling=True, cascade_attention=None):
            assert os.environ["ASYNCLLM_DECODE_GEMV"] == "on"
            assert os.environ["ASYNCLLM_CUDA_GRAPH_SAMPLING"] == "1"
            assert "ASYNCLLM_CASCADE_ATTENTION" not in os.environ
        assert os.environ["ASYNCLLM_DECODE_GEMV"] == "off"
        assert "ASYNCLLM_CUDA_GRAPH_SAMPLING" not in os.environ
        with (
            pytest.raises(SystemExit, match="'max_num_seqs' is no tuning variable"),
            engine_args.tuning_env(max_num_seqs=8),
        ):
            pass
