"""Command line: ``python -m actwave select --model ID --k 3`` picks draft layers for a model.

``select`` runs the pipeline of notebooks 01–05 for one model: the analysis capture
(``actwave.capture.store``), the layer statistics for all tokens and for the top-entropy tokens
(``actwave.stats.analysis``) and every selection method (``actwave.stats.selection_report``). The
capture and the statistics are cached under the keys the notebooks use; the defaults are
the ``cpu`` profile's values (``CPU_PROFILE_KEYS``), so after ``./reproduce.sh`` the
command on a bundled model reads notebooks 01–05's caches, and a rerun reads its own. It
prints each method's set with its scores and percentiles next to the EAGLE-3 default's,
and the ``eagle_aux_hidden_state_layer_ids`` each serving engine needs
(``actwave.eagle3.export.ENGINES``). Methods and percentiles: docs/METHODS.md §10;
engine rules: §15.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from actwave.capture.store import CaptureConfig, run_capture
from actwave.config import atomic_write_json
from actwave.eagle3.export import ENGINES, engine_layer_ids
from actwave.stats import analysis, selection_report
from actwave.stats.selection import METHODS

COLUMNS = (("renyi2", "H2 nats", "{:.4f}"), ("renyi2_pct", "H2 pct", "{:.1f}"),
           ("logdet_pct", "logdet pct", "{:.1f}"), ("entropy_sum_pct", "sum H1 pct", "{:.1f}"),
           ("dispersion_pct", "dispersion pct", "{:.1f}"))

# command-line option -> the profiles/cpu.yaml key its default equals (tests/test_cli.py)
CPU_PROFILE_KEYS = {"sequences": "analysis_sequences", "max_seq_len": "max_seq_len",
                    "filter_quantile": "filter_quantile", "dtype": "capture_dtype",
                    "batch_size": "capture_batch_size", "matmul_dtype": "stats_matmul_dtype",
                    "seed": "seed"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m actwave", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    select = commands.add_parser("select", help="choose k layers to feed an EAGLE-3 draft")
    select.add_argument("--model", required=True,
                        help="bundled name (smollm2-135m, gemma3-270m), HF id in the local "
                             "cache, or a local folder")
    select.add_argument("--k", type=int, default=3, help="layers per set (default 3)")
    select.add_argument("--sequences", type=int, default=64,
                        help="ShareGPT analysis conversations to capture (default 64)")
    select.add_argument("--max-seq-len", type=int, default=512, help="tokens per sequence")
    select.add_argument("--filter-quantile", type=float, default=0.5,
                        help="keep tokens whose predictive entropy is ≥ this quantile")
    select.add_argument("--max-tokens", type=int, default=0,
                        help="subsample the kept tokens to this many (0 = all)")
    select.add_argument("--method", action="append", choices=sorted(METHODS),
                        help="selection method(s) to run (repeatable; default: all). The "
                             "recommended method and the EAGLE-3 default always run; "
                             "greedy_aggregate_entropy dominates the cost on deep or wide models")
    select.add_argument("--engine", action="append", choices=sorted(ENGINES),
                        help="engine(s) to print ids for (repeatable; default: all)")
    select.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    select.add_argument("--dtype", default="float32", help="target compute dtype for capture")
    select.add_argument("--batch-size", type=int, default=4, help="capture batch size")
    select.add_argument("--matmul-dtype", default="float32", choices=analysis.MATMUL_DTYPES,
                        help="precision of the per-chunk cross products (sums stay float64)")
    select.add_argument("--seed", type=int, default=0)
    select.add_argument("--json", type=Path, help="also write the full result to this file")
    return parser


def run_select(args: argparse.Namespace) -> dict:
    """Capture, statistics and every method for ``args.model``; the result as plain data.

    The capture is keyed by the content digest of the model's files (computed on every call),
    the statistics by the store's content digest: new weights at the same path, or another
    model under the same folder name, never reuse an old store or its statistics."""
    tic = time.perf_counter()
    store = run_capture(CaptureConfig(
        model=args.model, split="analysis", n_sequences=args.sequences,
        max_seq_len=args.max_seq_len, batch_size=args.batch_size, dtype=args.dtype,
        seed=args.seed), device=args.device)
    num_layers = store.num_layers
    settings = analysis.token_settings(args.filter_quantile, max_tokens=args.max_tokens or None,
                                       seed=args.seed, matmul_dtype=args.matmul_dtype)
    config = selection_report.SelectionConfig(k=args.k, seed=args.seed)
    methods = _methods(config, num_layers, args.method)
    token_sets = {label: _token_set(store, setting, methods, args)
                  for label, setting in settings.items()}
    filtered = list(settings)[1]
    picks = {"recommended": _row(token_sets[filtered], config.combined_method)}
    if "eagle3_default" in methods:
        picks["eagle3_default"] = _row(token_sets[filtered], "eagle3_default")
    engines = args.engine or list(ENGINES)
    return {"model": args.model, "model_digest": store.manifest["model_digest"],
            "store": str(store.path), "store_digest": store.digest,
            "num_layers": num_layers, "hidden_size": store.hidden_size,
            "k": args.k, "store_tokens": store.n_tokens, "recommended_token_set": filtered,
            "recommended_method": config.combined_method,
            "n_subsets": math.comb(num_layers, args.k), "token_sets": token_sets,
            "picks": picks, "engine_ids": {name: _engine_ids(row["layers"], num_layers, engines)
                                           for name, row in picks.items()},
            "seconds": time.perf_counter() - tic}


def _methods(config: selection_report.SelectionConfig, num_layers: int,
             chosen: list[str] | None) -> dict:
    """The ``chosen`` methods (None: all) plus the recommended one and EAGLE-3's default,
    the latter only where it exists (k = 3, N ≥ 7)."""
    keep = set(chosen or METHODS) | {config.combined_method, "eagle3_default"}
    if config.k != 3 or num_layers < 7:
        keep.discard("eagle3_default")
    return {label: spec for label, spec in config.methods().items() if label in keep}


def _token_set(store, config: analysis.AnalysisConfig, methods: dict, args) -> dict:
    stats = analysis.compute_layer_stats(store, config, device=args.device)
    rows = selection_report.compare_methods(stats, methods, k=args.k)
    return {"n_tokens": stats.n_tokens, "n_seen": stats.n_seen,
            "methods": [{**row, "layers": list(row["layers"])} for row in rows]}


def _row(token_set: dict, label: str) -> dict:
    return next(row for row in token_set["methods"] if row["label"] == label)


def _engine_ids(layers, num_layers: int, engines) -> dict:
    """{engine: the ids to configure, or the reason it cannot serve ``layers``}."""
    out = {}
    for name in engines:
        try:
            out[name] = {"ids": engine_layer_ids(tuple(layers), num_layers, name)}
        except ValueError as err:
            out[name] = {"refused": str(err)}
    return out


def format_report(result: dict) -> str:
    """The printed report of ``run_select``'s result."""
    lines = [f"actwave select · {result['model']} (N={result['num_layers']}, "
             f"d={result['hidden_size']}) · k={result['k']} · {result['store_tokens']:,} "
             f"captured tokens · {result['seconds']:.0f} s",
             f"model files {result['model_digest']} · store {result['store']}", ""]
    for label, token_set in result["token_sets"].items():
        lines += _method_table(label, token_set, result) + [""]
    lines += [f"Percentiles: share of all C({result['num_layers']}, {result['k']}) = "
              f"{result['n_subsets']:,} sets of layers 1..N scoring at most as well "
              "(100 = best).", ""]
    names = {"recommended": f"recommended ({result['recommended_method']})",
             "eagle3_default": "EAGLE-3 default"}
    for name, row in result["picks"].items():
        lines.append(f"{names[name]:<34} {str(tuple(row['layers'])):<14} H2 percentile "
                     f"{row['renyi2_pct']:5.1f} on the {result['recommended_token_set']} tokens")
    return "\n".join(lines + [""] + _engine_table(result))


def _method_table(label: str, token_set: dict, result: dict) -> list[str]:
    marks = {result["recommended_method"]: "*", "eagle3_default": "D"}
    head = f"  {'method':<26}{'layers':<16}" + "".join(f"{t:>15}" for _, t, _ in COLUMNS)
    legend = ("  (* recommended, D EAGLE-3 default)"
              if label == result["recommended_token_set"] else "")
    lines = [f"token set '{label}': {token_set['n_tokens']:,} of {token_set['n_seen']:,} "
             f"tokens{legend}", head]
    for row in sorted(token_set["methods"], key=lambda r: -r["renyi2"]):
        mark = marks.get(row["label"], " ")
        cells = "".join(f"{fmt.format(row[key]):>15}" for key, _, fmt in COLUMNS)
        lines.append(f"{mark} {row['label']:<26}{str(tuple(row['layers'])):<16}{cells}")
    return lines


def _engine_table(result: dict) -> list[str]:
    lines = ["eagle_aux_hidden_state_layer_ids to configure (docs/METHODS.md §15):"]
    for engine in next(iter(result["engine_ids"].values())):
        lines.append(f"  {engine}  ->  {ENGINES[engine].where}")
        for name, per_engine in result["engine_ids"].items():
            entry = per_engine[engine]
            value = entry["ids"] if "ids" in entry else f"cannot serve: {entry['refused']}"
            lines.append(f"      {name:<15} {value}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m actwave``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "select":
        problem = _select_args_problem(args)
        if problem:
            parser.error(problem)  # exits with status 2 before any model is loaded
        try:
            result = run_select(args)
        except ValueError as err:  # a bad value found once the model is known (e.g. k > N)
            parser.error(str(err))
        print(format_report(result))
        if args.json:
            atomic_write_json(args.json, result)
    return 0


def _select_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the sizes given to ``select`` (None if nothing)."""
    for flag, value, low in (("--k", args.k, 1), ("--sequences", args.sequences, 1),
                             ("--max-seq-len", args.max_seq_len, 2),
                             ("--batch-size", args.batch_size, 1)):
        if value < low:
            return f"{flag} must be ≥ {low}, got {value}"
    if args.max_tokens != 0 and args.max_tokens < 4:
        return f"--max-tokens must be 0 (all tokens) or ≥ 4, got {args.max_tokens}"
    if not 0.0 <= args.filter_quantile < 1.0:
        return f"--filter-quantile must be in [0, 1), got {args.filter_quantile}"
    return None
