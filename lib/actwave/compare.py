"""Did a rerun reproduce the committed tables? ``./reproduce.sh --compare [--profile cpu]``.

Re-running a profile on another CPU changes float results in the 5th–6th significant digit
(different SIMD reductions), so figures are not byte-identical across machines; the
conclusions are. This module compares every committed table of ``results/<profile>/``
(``git show HEAD:...``) with the regenerated one in the working tree, cell by cell:

* text, integer and boolean cells — model names, layer sets such as ``"4,14,17"``, token
  counts, ranks — must be equal exactly, and so must the selected layer sets of
  ``05_candidate_sets.json``;
* float cells pass when ``|fresh - committed| <= atol + rtol * |committed|``, with the
  tolerance of the first rule in :data:`RULES` that matches the table and column
  (bracketed intervals such as ``"[1.23, 1.29]"`` are compared number by number);
* wall-clock columns (seconds, tokens/s, speedup) are machine-dependent and not compared.

``python -m actwave.compare --profile cpu`` prints one line per table and exits 1 on any
mismatch (2 when nothing is committed to compare with).
"""
from __future__ import annotations

import argparse
import fnmatch
import io
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from actwave.config import repo_root


@dataclass(frozen=True)
class Tolerance:
    """``|fresh - committed| <= atol + rtol * |committed|``; ``None`` = not compared."""
    rtol: float
    atol: float


SKIP = None
# (table glob, column glob, tolerance), first match wins; see the module docstring.
RULES: tuple[tuple[str, str, Tolerance | None], ...] = (
    ("*", "seconds", SKIP),
    ("*", "tokens_per_s*", SKIP),
    ("*", "*speedup*", SKIP),
    # Percentile among all C(N, k) subsets: a near-tie may move a set by one rank,
    # 100 / C(19, 3) = 0.1 points for Gemma-3 (N=18).
    ("0[1-5]_*", "*_pct", Tolerance(rtol=0, atol=0.25)),
    ("0[1-5]_*", "*", Tolerance(rtol=1e-4, atol=1e-6)),
    # Trained drafts and their acceptance inherit every rounding difference of 48 steps.
    ("0[6-7]_*", "*", Tolerance(rtol=5e-2, atol=2e-2)),
)
EXACT_JSON = ("05_candidate_sets.json",)


def rule_for(table: str, column: str) -> Tolerance | None:
    """The tolerance of the first matching rule (exact-match floats if none matches)."""
    for table_glob, column_glob, tolerance in RULES:
        if fnmatch.fnmatchcase(table, table_glob) and fnmatch.fnmatchcase(column, column_glob):
            return tolerance
    return Tolerance(rtol=0, atol=0)


@dataclass
class Report:
    """Outcome for one table: ``problems`` lists each mismatch; ``skipped`` the columns
    not compared; ``worst`` the largest relative float difference seen."""
    table: str
    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    worst: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def _is_text(values: pd.Series) -> bool:
    return values.dtype == object or pd.api.types.is_string_dtype(values)


def _text(values: pd.Series) -> pd.Series:
    """Cells as strings, an empty cell as "" (so two empty cells are equal)."""
    return values.astype(object).where(values.notna(), "").astype(str)


def _intervals(values: pd.Series) -> np.ndarray | None:
    """A column of ``"[lo, hi]"`` strings as an (n, 2) float array, else None."""
    if not _is_text(values) or values.isna().any():
        return None
    text = _text(values).str.strip()
    if not text.str.fullmatch(r"\[[^\[\]]*\]").all():
        return None
    try:
        return np.array([[float(x) for x in cell[1:-1].split(",")] for cell in text])
    except ValueError:
        return None


def _numeric(committed: pd.Series, fresh: pd.Series) -> tuple[np.ndarray, np.ndarray] | None:
    """Both columns as (n, width) floats when either holds floats (or both hold intervals);
    None for text, integer and boolean columns, which must match exactly."""
    numeric = [pd.api.types.is_numeric_dtype(c) and not pd.api.types.is_bool_dtype(c)
               for c in (committed, fresh)]
    if all(numeric) and any(pd.api.types.is_float_dtype(c) for c in (committed, fresh)):
        return committed.to_numpy(dtype=float)[:, None], fresh.to_numpy(dtype=float)[:, None]
    pair = (_intervals(committed), _intervals(fresh))
    if not any(numeric) and all(p is not None for p in pair) and pair[0].shape == pair[1].shape:
        return pair
    return None


def _row_label(frame: pd.DataFrame, row: int) -> str:
    """The row's text cells (its key, e.g. model/setting/label), for messages."""
    keys = [c for c in frame.columns if _is_text(frame[c])][:3]
    return ", ".join(f"{c}={frame[c].iloc[row]}" for c in keys) or f"row {row}"


def _compare_floats(report: Report, column: str, committed: np.ndarray, fresh: np.ndarray,
                    tolerance: Tolerance, frame: pd.DataFrame) -> None:
    both_nan = np.isnan(committed) & np.isnan(fresh)
    diff = np.where(both_nan, 0.0, np.abs(fresh - committed))
    allowed = tolerance.atol + tolerance.rtol * np.abs(committed)
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(diff > 0, diff / np.abs(committed), 0.0)
    report.worst = max(report.worst, float(np.nanmax(relative, initial=0.0)))
    for row in np.flatnonzero((~(both_nan | (diff <= allowed))).any(axis=1)):
        report.problems.append(
            f"{column} [{_row_label(frame, row)}]: {fresh[row].tolist()} vs committed "
            f"{committed[row].tolist()} (allowed ±atol {tolerance.atol:g} + rtol "
            f"{tolerance.rtol:g})")


def compare_tables(table: str, committed: pd.DataFrame, fresh: pd.DataFrame) -> Report:
    """Compare two versions of one table cell by cell under :data:`RULES`."""
    report = Report(table)
    if list(committed.columns) != list(fresh.columns) or len(committed) != len(fresh):
        report.problems.append(f"shape {fresh.shape} columns {list(fresh.columns)} vs committed "
                               f"{committed.shape} {list(committed.columns)}")
        return report
    for column in committed.columns:
        tolerance = rule_for(table, column)
        if tolerance is SKIP:
            report.skipped.append(column)
            continue
        floats = _numeric(committed[column], fresh[column])
        if floats is not None:
            _compare_floats(report, column, *floats, tolerance, committed)
            continue
        for row in np.flatnonzero(_text(committed[column]) != _text(fresh[column])):
            report.problems.append(f"{column} [{_row_label(committed, row)}]: "
                                   f"{fresh[column].iloc[row]!r} vs committed "
                                   f"{committed[column].iloc[row]!r} (must match exactly)")
    return report


def _flatten(document: object, prefix: str = "") -> dict[str, object]:
    """Nested dicts as {"a/b": leaf}, so a message names the entry that differs."""
    if not isinstance(document, dict):
        return {prefix or "(document)": document}
    flat: dict[str, object] = {}
    for key, value in document.items():
        flat.update(_flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return flat


def compare_json(table: str, committed: object, fresh: object) -> Report:
    """Exact comparison of a JSON document, entry by entry."""
    report = Report(table)
    old, new = _flatten(committed), _flatten(fresh)
    report.problems += [f"{key}: {new.get(key)} vs committed {old.get(key)} (must match "
                        f"exactly)" for key in sorted(set(old) | set(new))
                        if old.get(key) != new.get(key)]
    return report


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo_root(), check=True, capture_output=True,
                          text=True).stdout


def compare_profile(profile: str, revision: str = "HEAD") -> list[Report]:
    """Compare every committed CSV table and exact-JSON file of results/<profile>/ at
    ``revision`` with the working tree's copy."""
    folder = f"results/{profile}"
    committed = [Path(p).name for p in _git("ls-tree", "--name-only", revision, f"{folder}/")
                 .splitlines() if p.endswith(".csv") or Path(p).name in EXACT_JSON]
    reports = []
    for name in committed:
        fresh_path = repo_root() / folder / name
        if not fresh_path.exists():
            reports.append(Report(name, problems=["not regenerated (missing)"]))
            continue
        old_text = _git("show", f"{revision}:{folder}/{name}")
        if name.endswith(".json"):
            reports.append(compare_json(name, json.loads(old_text),
                                        json.loads(fresh_path.read_text())))
        else:
            reports.append(compare_tables(name, pd.read_csv(io.StringIO(old_text)),
                                          pd.read_csv(fresh_path)))
    return reports


def format_report(report: Report, max_lines: int = 5) -> list[str]:
    """One summary line per table, then up to ``max_lines`` mismatches."""
    skipped = f"; not compared (machine timing): {', '.join(report.skipped)}" \
        if report.skipped else ""
    if report.ok:
        return [f"match     {report.table} (largest relative difference "
                f"{report.worst:.1e}){skipped}"]
    lines = [f"MISMATCH  {report.table}: {len(report.problems)} differences{skipped}"]
    lines += [f"    {problem}" for problem in report.problems[:max_lines]]
    if len(report.problems) > max_lines:
        lines.append(f"    ... {len(report.problems) - max_lines} more")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actwave.compare",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--revision", default="HEAD", help="git revision of the reference")
    args = parser.parse_args(argv)
    reports = compare_profile(args.profile, args.revision)
    if not reports:
        print(f"reproduce.sh: nothing committed under results/{args.profile}/ at "
              f"{args.revision} to compare with", file=sys.stderr)
        return 2
    for report in reports:
        print("\n".join(format_report(report)))
    bad = [r.table for r in reports if not r.ok]
    print(f"{len(reports) - len(bad)} of {len(reports)} tables match the committed "
          f"results/{args.profile}/" + (f"; differ: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
