"""actwave.tools.steplog: the per-step cost log reproduce.sh writes (wall time, memory, exit
code)."""
from __future__ import annotations

import csv
import sys

from actwave.tools import steplog

# Holds ~200 MB resident for 2.5 s in a grandchild, the way papermill holds its kernel.
ALLOCATE = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "\"import time; block = bytearray(200 * 2**20); time.sleep(2.5)\"], check=True); "
            "sys.exit(3)")


def test_logs_grandchild_memory_wall_time_and_exit_code(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    log = tmp_path / "steps.tsv"
    code = steplog.main([str(log), "01_probe", "--", sys.executable, "-c", ALLOCATE])
    assert code == 3
    assert steplog.main([str(log), "02_true", "--", sys.executable, "-c", "pass"]) == 0
    rows = list(csv.DictReader(log.open(), delimiter="\t"))
    assert [row["step"] for row in rows] == ["01_probe", "02_true"]
    first = rows[0]
    assert first["exit_code"] == "3"
    assert float(first["wall_s"]) >= 2
    assert 0.15 <= float(first["peak_rss_gib"]) < 2  # the grandchild's 200 MB is counted
    assert float(first["cache_gib"]) == 0  # the empty cache folder


def test_directory_bytes_sums_nested_files(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "one").write_bytes(b"1" * 10)
    (tmp_path / "a" / "b" / "two").write_bytes(b"2" * 5)
    assert steplog.directory_bytes(tmp_path) == 15
    assert steplog.directory_bytes(tmp_path / "missing") == 0
