"""The replicas' actor options: the tuning variables set in the pool's process (asyncllm.envs) go with every
actor, whose process does not inherit that environment, beside any env_vars of `ray_actor_options`, which win.
No cluster: the actor class's `options` is recorded instead of called."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("ray")


def _options(monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any] | None) -> dict[str, Any]:
    from asyncllm.ray import placement

    recorded: list[dict[str, Any]] = []

    class _Actor:
        def options(self, **options: Any) -> _Actor:
            recorded.append(options)
            return self

        def remote(self) -> None:
            return None

    monkeypatch.setattr(placement.ray, "remote", lambda cls: _Actor())
    spawns, _ = placement.replica_spawns(1, 0, overrides)
    spawns[0]()
    return recorded[0]


def test_tuning_variables_go_with_the_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("ASYNCLLM_")]:
        monkeypatch.setenv(name, "")  # unset for this test, whatever the caller's environment (or conftest) holds
    assert "runtime_env" not in _options(monkeypatch, None)  # none set: the options as before
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "off")
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_MAX_TOKENS", "0")
    given = {"runtime_env": {"env_vars": {"ASYNCLLM_CUDA_GRAPH_MAX_TOKENS": "64", "OTHER": "1"}}}
    env_vars = _options(monkeypatch, given)["runtime_env"]["env_vars"]
    assert env_vars == {"ASYNCLLM_DECODE_GEMV": "off", "ASYNCLLM_CUDA_GRAPH_MAX_TOKENS": "64", "OTHER": "1"}
