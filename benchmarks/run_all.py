"""Every performance benchmark in one run, then one summary table of the ratios they measure.

    .venv/bin/python benchmarks/run_all.py [--size quick|full] [--only capture,metrics,...]
        [--draft DIR] [--out results/benchmarks]

Each ratio compares two routes measured side by side in the same benchmark run (never a
number from another machine or day). ``--size quick`` (~5 min on 2 cores) shrinks every
benchmark to a smoke size; ``full`` (the default) uses the sizes the README quotes.
The trained draft for the speculative and round benchmarks is ``--draft`` (a folder), else
the benchmark draft of ``benchmarks/train_draft.py`` (``results/benchmarks/draft.json``),
else notebook 06's EAGLE-3-default draft from its manifest (``--drafts``), whichever is
first found in the cache; otherwise a random draft stands in and the summary says so. The table is printed and written to ``<out>/summary.{csv,md}`` with
the machine and package versions in ``<out>/summary.json``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the bench_* scripts sit beside this file

from actwave.config import (atomic_write_bytes, atomic_write_json, cache_dir,  # noqa: E402
                            cpu_flags, native_bf16, package_versions, repo_root)
from actwave.plots import to_markdown  # noqa: E402

FAST_DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
# Arguments per benchmark and size; each bench_<name>.main(argv) returns summary rows.
SIZES = {
    "full": {
        "capture": ["--batches", "4"],
        "metrics": ["--layers", "31", "--tokens", "16384", "--dim", "576"],
        "regenerate": ["--n-batched", "16", "--n-single", "4", "--max-new-tokens", "64",
                       "--dtype", FAST_DTYPE],
        "train": ["--steps", "3", "--dtypes", FAST_DTYPE],
        "round": ["--n-prompts", "2", "--max-new-tokens", "64"],
        "speculative": ["--n-prompts", "20", "--max-new-tokens", "128"],
        # bf16 beside fp32 where the machine computes bf16 natively: speed and exact-match rate
        "speculative-bf16": ["--n-prompts", "20", "--max-new-tokens", "128", "--dtype", "bfloat16"],
    },
    "quick": {
        "capture": ["--batches", "2", "--seq-len", "128"],
        "metrics": ["--layers", "8", "--tokens", "8192", "--dim", "256",
                    "--compare-tokens", "1500"],
        "regenerate": ["--n-batched", "4", "--n-single", "2", "--max-new-tokens", "16",
                       "--dtype", FAST_DTYPE],
        "train": ["--steps", "1", "--seq-len", "128", "--dtypes", FAST_DTYPE],
        "round": ["--n-prompts", "1", "--max-new-tokens", "16", "--repeats", "2"],
        "speculative": ["--n-prompts", "1", "--max-new-tokens", "32", "--acceptance-prompts", "1"],
        "speculative-bf16": ["--n-prompts", "1", "--max-new-tokens", "32", "--acceptance-prompts",
                             "1", "--dtype", "bfloat16"],
    },
}
BENCHMARKS = tuple(SIZES["full"])


def draft_arguments(bench_draft: Path, manifest: Path, model: str = "smollm2-135m") -> list[str]:
    """--draft: train_draft.py's draft, else notebook 06's EAGLE-3-default one, if cached."""
    folders = []
    if bench_draft.exists():
        folders.append(json.loads(bench_draft.read_text())["draft"])
    if manifest.exists():
        folders.append(json.loads(manifest.read_text()).get(model, {}).get("eagle3_default"))
    found = [folder for folder in folders if folder and (cache_dir() / folder).is_dir()]
    return ["--draft", found[0]] if found else []


def run_benchmarks(size: str, names: list[str], drafts: list[str]) -> pd.DataFrame:
    """Run each named benchmark in turn; one row per ratio, with its wall time. A
    ``<bench>-<variant>`` entry runs ``bench_<bench>`` with its own arguments; the bf16
    variant only where bf16 is native (else it is skipped and says so)."""
    rows = []
    for name in names:
        argv = list(SIZES[size][name])
        module = name.split("-")[0]
        if name.endswith("-bf16") and not native_bf16():
            print(f"\n===== {name}: skipped, no native bf16 on this machine ({cpu_flags()})")
            continue
        if module in ("speculative", "round"):
            argv += drafts
        print(f"\n===== bench_{module} {' '.join(argv)}", flush=True)
        tic = time.perf_counter()
        results = importlib.import_module(f"bench_{module}").main(argv)
        seconds = time.perf_counter() - tic
        rows += [{**row, "bench_seconds": round(seconds, 1)} for row in results]
    return pd.DataFrame(rows)


def write_summary(table: pd.DataFrame, out: Path, size: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "summary.csv", table.to_csv(index=False, float_format="%.3f",
                                                         lineterminator="\n").encode())
    atomic_write_bytes(out / "summary.md", to_markdown(table, "%.3f").encode())
    atomic_write_json(out / "summary.json", {
        "size": size, "machine": platform.platform(), "processor": platform.processor(),
        "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
        "cpu_flags": cpu_flags(),
        "versions": package_versions()})


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--bench-draft", type=Path,
                        default=repo_root() / "results/benchmarks/draft.json")
    parser.add_argument("--drafts", type=Path, default=repo_root() / "results/cpu/06_drafts.json")
    parser.add_argument("--draft", help="trained draft folder for speculative/round (overrides --drafts)")
    parser.add_argument("--out", type=Path, default=repo_root() / "results/benchmarks")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown or not names:
        parser.error(f"unknown benchmark(s) {unknown or names}; choose from {BENCHMARKS}")
    drafts = ["--draft", args.draft] if args.draft else draft_arguments(args.bench_draft,
                                                                        args.drafts)
    table = run_benchmarks(args.size, names, drafts)
    write_summary(table, args.out, args.size)
    print(f"\n===== summary ({args.size}; ratios of routes measured side by side)")
    print(table.to_string(index=False, float_format="%.3f"))
    return table


if __name__ == "__main__":
    main()
