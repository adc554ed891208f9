"""bench/kv_reads_gil.py at a small size: both readers read every block back, alone and beside a busy thread,
and the line it prints has each way's figures."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.bench.scripts import bench_script

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the reader process needs memfd_create")


def test_both_readers_read_everything_and_report(monkeypatch, capsys) -> None:
    with bench_script("kv_reads_gil") as module:
        monkeypatch.setattr(sys, "argv", ["kv_reads_gil.py", "--files", "12", "--block-mib", "0.05", "--threads", "2"])
        module.main()  # asserts that every read arrived
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for way in ("threads_alone", "threads_beside_busy", "process_alone", "process_beside_busy"):
        assert line[way]["seconds"] > 0 and line[way]["gb_s"] > 0
    assert line["threads_beside_busy"]["busy_ops_per_ms"] > 0 and line["process_beside_busy"]["busy_ops_per_ms"] > 0
