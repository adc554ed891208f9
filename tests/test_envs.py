"""The tuning variables (asyncllm.envs): read when used, defaults when unset or empty, a bad value refused
naming the variable, and every one documented in docs/tuning.md."""

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


def test_every_variable_is_documented_with_its_default() -> None:
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip() for line in DOC.read_text().splitlines()
            if line.startswith("| `ASYNCLLM_")}  # fmt: skip
    assert set(rows) == {var.name for var in envs.ALL}
    for var in envs.ALL:
        assert float(rows[var.name]) == var.default, var.name
