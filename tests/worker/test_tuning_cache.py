"""`ChoiceCache` (worker/tuning_cache.py), the start-up GEMM choices kept on disk, on CPU: what one start keeps
the next reads; a file that does not parse, or an entry that is not a choice, is timed again (never trusted);
another card or library version names another file; nothing is kept for a CPU device or with
ASYNCLLM_TUNING_CACHE=0. (An engine taking kept choices on the GPU: tests/gpu/test_tuning_cache.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from asyncllm.worker.tuning_cache import ChoiceCache, cache_root, identity

PLAIN = {"transposed": False, "gemv": False, "prologue": False}
GEMV = {"transposed": False, "gemv": True, "prologue": False}


def test_what_one_start_keeps_the_next_reads(tmp_path: Path) -> None:
    path = tmp_path / "tuning" / "gemm-x.json"
    first = ChoiceCache(path)
    assert first.get("1024x3072:torch.bfloat16:-:gemv") is None
    first.put("1024x3072:torch.bfloat16:-:gemv", GEMV)
    first.put("3072x1024:torch.bfloat16:silu_mul:gemv", PLAIN)
    first.save()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    second = ChoiceCache(path)
    assert second.get("1024x3072:torch.bfloat16:-:gemv") == GEMV
    assert second.get("3072x1024:torch.bfloat16:silu_mul:gemv") == PLAIN
    second.put("2048x1024:torch.bfloat16:-:cublas", PLAIN)  # a new shape adds to what was kept
    second.save()
    assert len(json.loads(path.read_text())["choices"]) == 3


def test_engines_saving_together_keep_each_others_choices(tmp_path: Path) -> None:
    """Two engines (or tensor-parallel ranks) that read the file before either wrote: the second to save keeps
    the first's new entries."""
    path = tmp_path / "gemm-x.json"
    a, b = ChoiceCache(path), ChoiceCache(path)
    a.put("1024x3072:torch.bfloat16:-:gemv", GEMV)
    b.put("512x3072:torch.bfloat16:-:gemv", PLAIN)
    a.save()
    b.save()
    both = ChoiceCache(path)
    assert both.get("1024x3072:torch.bfloat16:-:gemv") == GEMV and both.get("512x3072:torch.bfloat16:-:gemv") == PLAIN


@pytest.mark.parametrize(
    "text",
    ["{not json", json.dumps({"version": 99, "choices": {}}), json.dumps([1, 2]), ""],
    ids=["garbled", "another-version", "not-a-table", "empty"],
)
def test_a_file_that_does_not_parse_is_timed_again(tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gemm-x.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="asyncllm.worker.tuning_cache"):
        cache = ChoiceCache(path)
    assert cache.get("1024x3072:torch.bfloat16:-:gemv") is None
    assert "timing again" in caplog.text
    cache.put("1024x3072:torch.bfloat16:-:gemv", GEMV)
    cache.save()
    assert ChoiceCache(path).get("1024x3072:torch.bfloat16:-:gemv") == GEMV  # rewritten whole


def test_an_entry_that_is_not_a_choice_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "gemm-x.json"
    choices = {"a": GEMV, "b": {"transposed": "yes", "gemv": False, "prologue": False}, "c": {"gemv": True}, "d": 3}
    path.write_text(json.dumps({"version": 1, "choices": choices}))
    cache = ChoiceCache(path)
    assert cache.get("a") == GEMV
    assert [cache.get(e) for e in "bcd"] == [None, None, None]


def test_another_card_or_library_names_another_file() -> None:
    facts = {"card": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "driver": 13000, "torch": "2.11.0", "triton": "3.6"}
    assert identity(facts) == identity(dict(facts))
    for change in ({"card": "NVIDIA H200"}, {"driver": 13010}, {"torch": "2.12.0"}, {"triton": "3.7"}):
        assert identity(facts | change) != identity(facts)


def test_nothing_is_kept_for_a_cpu_device_or_when_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ASYNCLLM_TUNING_CACHE", "1")  # off for every other test (tests/conftest.py)
    assert cache_root() == tmp_path / "asyncllm" / "tuning"
    cpu = ChoiceCache.for_device(torch.device("cpu"))
    cpu.put("1024x3072:torch.bfloat16:-:gemv", GEMV)
    cpu.save()
    assert cpu.path is None and not (tmp_path / "asyncllm").exists()
    monkeypatch.setenv("ASYNCLLM_TUNING_CACHE", "0")
    assert ChoiceCache.for_device(torch.device("cuda")).path is None  # not even asked of the card
