"""Run one reproduction step and log what it cost: wall time, peak memory, cache disk.

``python -m actwave.tools.steplog LOG NAME -- COMMAND...`` runs COMMAND, samples the resident
memory of its whole process tree (papermill and the kernel it starts) once a second from
``/proc``, then appends one row to the TSV file LOG and exits with COMMAND's status.
``reproduce.sh`` wraps every notebook with it, so each profile's folder holds
``steps.tsv``: the numbers the README quotes for an end-to-end run.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from actwave.config import cache_dir

COLUMNS = ("step", "started_utc", "wall_s", "peak_rss_gib", "cache_gib", "exit_code")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _children_by_parent() -> dict[int, list[int]]:
    """{ppid: [pid, ...]} of every process readable under /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name (field 2) may hold spaces; fields after its ')' are fixed.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def tree_rss_bytes(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants (0 where /proc is unavailable)."""
    if not Path("/proc").is_dir():
        return 0
    children, total, stack = _children_by_parent(), 0, [root]
    while stack:
        pid = stack.pop()
        try:
            resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        total += resident_pages * PAGE_BYTES
        stack.extend(children.get(pid, []))
    return total


def directory_bytes(path: Path) -> int:
    """Apparent size of every file under ``path`` (0 if it does not exist)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_logged(command: list[str], interval_s: float = 1.0) -> tuple[int, float, int]:
    """Run ``command``; return (exit code, wall seconds, peak tree RSS in bytes)."""
    start = time.monotonic()
    process = subprocess.Popen(command)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss_bytes(process.pid))
        time.sleep(interval_s)
    return process.returncode, time.monotonic() - start, peak


def append_row(log: Path, row: dict) -> None:
    """Append ``row`` to the TSV ``log``, writing the header when the file is new."""
    new = not log.exists()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, delimiter="\t")
        if new:
            writer.writeheader()
        writer.writerow(row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("step")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after the step name")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    code, wall_s, peak = run_logged(command)
    gib = 1024 ** 3
    append_row(args.log, {"step": args.step, "started_utc": started, "wall_s": f"{wall_s:.0f}",
                          "peak_rss_gib": f"{peak / gib:.2f}",
                          "cache_gib": f"{directory_bytes(cache_dir()) / gib:.2f}",
                          "exit_code": code})
    return code


if __name__ == "__main__":
    sys.exit(main())
