"""The tuning variables (asyncllm.envs): read when used, defaults when unset or empty, each parser's values
(switches, choices, counts or "auto"), a bad value refused naming the variable and the values it takes, and
every one documented in docs/tuning.md with its default."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncllm import envs
from asyncllm.errors import InvalidConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"


def test_a_variable_is_read_when_used(monkeypatch: pytest.MonkeyPatch) -> None:
    var = envs.DEAD_ENGINE_JOIN_S
    monkeypatch.delenv(var.name, raising=False)
    assert var.get() == var.default
    monkeypatch.setenv(var.name, " ")
    assert var.get() == var.default
    monkeypatch.setenv(var.name, "0.25")
    assert var.get() == 0.25


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "nan", "inf"])
def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(envs.DEAD_ENGINE_JOIN_S.name, raw)
    with pytest.raises(InvalidConfigError, match="ASYNCLLM_DEAD_ENGINE_JOIN_S"):
        envs.DEAD_ENGINE_JOIN_S.get()


@pytest.mark.parametrize(
    ("var", "raw", "value"),
    [
        (envs.DECODE_PDL, "1", True),
        (envs.DECODE_PDL, "TRUE", True),
        (envs.DECODE_PDL, " false ", False),
        (envs.DECODE_FOLD_REDUCE, "0", False),
        (envs.TP_CUSTOM_ALL_REDUCE, "false", False),
        (envs.CUDA_GRAPH_SAMPLING, "true", True),
        (envs.DECODE_GEMV, "on", envs.DecodeGemv.ON),
        (envs.DECODE_GEMV, "Off", envs.DecodeGemv.OFF),
        (envs.CASCADE_ATTENTION, "auto", envs.CascadeAttention.AUTO),
        (envs.CUDA_GRAPH_MAX_TOKENS, "auto", None),
        (envs.CUDA_GRAPH_MAX_TOKENS, "0", 0),
        (envs.CUDA_GRAPH_MAX_TOKENS, "4096", 4096),
    ],
)
def test_each_parser_reads_its_values(
    monkeypatch: pytest.MonkeyPatch, var: envs.EnvVar[object], raw: str, value: object
) -> None:
    monkeypatch.setenv(var.name, raw)
    assert var.get() == value


@pytest.mark.parametrize(
    ("var", "raw", "accepted"),
    [
        (envs.DECODE_PDL, "yes", "use 1, 0, true or false"),
        (envs.DECODE_FOLD_REDUCE, "2", "use 1, 0, true or false"),
        (envs.TP_CUSTOM_ALL_REDUCE, "off", "use 1, 0, true or false"),
        (envs.CUDA_GRAPH_SAMPLING, "on", "use 1, 0, true or false"),
        (envs.DECODE_GEMV, "always", "use one of auto, on, off"),
        (envs.CASCADE_ATTENTION, "1", "use one of auto, on, off"),
        (envs.CUDA_GRAPH_MAX_TOKENS, "-1", "use auto or an integer >= 0"),
        (envs.CUDA_GRAPH_MAX_TOKENS, "2.5", "use auto or an integer >= 0"),
        (envs.CUDA_GRAPH_MAX_TOKENS, "none", "use auto or an integer >= 0"),
    ],
)
def test_a_bad_value_names_the_variable_and_the_values_it_takes(
    monkeypatch: pytest.MonkeyPatch, var: envs.EnvVar[object], raw: str, accepted: str
) -> None:
    monkeypatch.setenv(var.name, raw)
    with pytest.raises(InvalidConfigError) as info:
        var.get()
    assert str(info.value).startswith(f"{var.name}={raw!r} is invalid ({accepted})")


def test_the_workers_variables_are_read_together_and_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the workers build with is read in one go where the engine resolves its model (`WorkerTuning`, sent
    to every rank), "auto" graph tokens settled for the engine's step budget; a bad value fails there."""
    from asyncllm.config import EngineConfig
    from asyncllm.worker.tuning import WorkerTuning

    config = EngineConfig.from_kwargs("m", max_num_seqs=16).resolved(streaming=True)
    assert WorkerTuning.read(config).cuda_graph_max_tokens == config.graph_max_tokens(None) == 16 + 2048
    monkeypatch.setenv(envs.CUDA_GRAPH_MAX_TOKENS.name, "64")
    monkeypatch.setenv(envs.DECODE_GEMV.name, "on")
    tuning = WorkerTuning.read(config)
    assert (tuning.cuda_graph_max_tokens, tuning.decode_gemv) == (64, envs.DecodeGemv.ON)
    monkeypatch.setenv(envs.CASCADE_ATTENTION.name, "yes")
    with pytest.raises(InvalidConfigError, match="ASYNCLLM_CASCADE_ATTENTION='yes' is invalid"):
        WorkerTuning.read(config)


def test_every_variable_is_documented_with_its_default() -> None:
    """docs/tuning.md's table names every variable once, its default written as one would set it."""
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip(" `") for line in DOC.read_text().splitlines()
            if line.startswith("| `ASYNCLLM_")}  # fmt: skip
    assert set(rows) == {var.name for var in envs.ALL}
    for var in envs.ALL:
        assert var.parse(rows[var.name]) == var.default, var.name
