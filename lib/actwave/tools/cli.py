"""The actwave command (also python -m actwave): one subcommand per tool.

    actwave select --model ID [--k 3]     pick draft layers for a model (below)
    actwave plan [--profile P]            what a profile's steps need (actwave.tools.plan)
    actwave run notebooks|run …           a profile's notebooks (actwave.tools.runplan)
    actwave compare [--profile P]         a rerun against the committed tables (actwave.tools.compare)
    actwave train --model ID --store …    train one draft (actwave.eagle3.train)
    actwave bench [--size quick]          every benchmark (benchmarks/run_all.py of a checkout)

Every subcommand but ``select`` hands its arguments to that module's ``main(argv)``, so
``actwave <command> --help`` is the module's own help.

``select`` runs the pipeline of notebooks 01–05 for one model: the analysis capture
(``actwave.capture.store``), the layer statistics for all tokens and for the top-entropy tokens
(``actwave.stats.analysis``) and every selection method (``actwave.stats.selection_report``). The
capture and the statistics are cached under the keys the notebooks use; the defaults are
the ``cpu`` profile's values (``profile_defaults``), so after ``./reproduce.sh`` the
command on a bundled model reads notebooks 01–05's caches, and a rerun reads its own. It
prints each method's set with its scores and percentiles next to the EAGLE-3 default's,
and what the layer-set study found of them (the proxies measure hidden states, not draft
acceptance), and recommends the EAGLE-3 default with the
``eagle_aux_hidden_state_layer_ids`` each serving engine needs
(``actwave.eagle3.export.ENGINES``). ``--validate`` trains short drafts for the top
candidates and the default and recommends a candidate only when it is significantly better
(``actwave.tools.validate``, which states the rule). Methods and percentiles:
docs/METHODS.md §10; engine rules: §15.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

import torch

from actwave.capture.store import run_capture
from actwave.config import atomic_write_json, repo_root
from actwave.eagle3.export import ENGINES, engine_layer_ids
from actwave.index import cache_relative
from actwave.profile import build, parameters
from actwave.stats import analysis, selection_report
from actwave.stats.selection import METHODS
from actwave.tools import validate
from actwave.tools.runplan import load_profile

CPU_PROFILE = "cpu"  # the profile whose values the select options default to
COLUMNS = (("renyi2", "H2 nats", "{:.4f}"), ("renyi2_pct", "H2 pct", "{:.1f}"),
           ("logdet_pct", "logdet pct", "{:.1f}"), ("entropy_sum_pct", "sum H1 pct", "{:.1f}"),
           ("dispersion_pct", "dispersion pct", "{:.1f}"))

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actwave", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    add_select_parser(commands)
    for name, (help_text, _) in DELEGATES.items():
        commands.add_parser(name, help=help_text, add_help=False)  # its module parses the rest
    return parser


def add_select_parser(commands) -> None:
    """``actwave select``: choose k layers for a model (``run_select``)."""
    select = commands.add_parser("select", help="choose k layers to feed an EAGLE-3 draft")
    select.add_argument("--model", required=True,
                        help="bundled name (smollm2-135m, gemma3-270m), HF id in the local "
                             "cache, or a local folder")
    # Options named (dest) as profile parameters default to the cpu profile's values, so the
    # command reads the caches ./reproduce.sh left (same capture and statistics keys).
    select.add_argument("--k", type=int, help="layers per set (default %(default)s)")
    select.add_argument("--sequences", dest="capture_n_sequences", type=int,
                        help="ShareGPT analysis conversations to capture (default %(default)s)")
    select.add_argument("--max-seq-len", dest="capture_max_seq_len", type=int,
                        help="tokens per sequence (default %(default)s)")
    select.add_argument("--source", dest="capture_source", default="sharegpt",
                        choices=("sharegpt", "regenerated"),
                        help="replies of the captured conversations: ShareGPT's originals, or "
                             "the target's own greedy ones (regenerated once and cached, as a "
                             "draft trains on them; default %(default)s)")
    select.add_argument("--regen-new-tokens", dest="capture_regen_new_tokens", type=int,
                        default=256, help="reply budget with --source regenerated (default "
                                          "%(default)s)")
    select.add_argument("--filter-quantile", type=float,
                        help="keep tokens whose predictive entropy is ≥ this quantile")
    select.add_argument("--max-tokens", type=int,
                        help="subsample the kept tokens to this many (0 = all)")
    select.add_argument("--method", action="append", choices=sorted(METHODS),
                        help="selection method(s) to run (repeatable; default: all). The "
                             "top-proxy method (renyi2_exhaustive) and the EAGLE-3 default "
                             "always run; greedy_aggregate_entropy dominates the cost on deep "
                             "or wide models")
    select.add_argument("--engine", action="append", choices=sorted(ENGINES),
                        help="engine(s) to print ids for (repeatable; default: all)")
    # The device is this machine's, not the profile's.
    select.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    select.add_argument("--dtype", dest="capture_dtype",
                        help="target compute dtype for capture (default %(default)s)")
    select.add_argument("--batch-size", dest="capture_batch_size", type=int,
                        help="capture batch size (default %(default)s)")
    select.add_argument("--matmul-dtype", choices=analysis.MATMUL_DTYPES,
                        help="precision of the per-chunk cross products (sums stay float64)")
    select.add_argument("--seed", type=int)
    select.add_argument("--json", type=Path, help="also write the full result to this file")
    validate.add_arguments(select)
    select.set_defaults(**profile_defaults(select, CPU_PROFILE))


def profile_defaults(parser: argparse.ArgumentParser, name: str) -> dict:
    """{dest: value} of profile ``name``'s parameters for the options of ``parser`` named as
    one (``actwave.profile``) and without a default of their own."""
    values = parameters(load_profile(name))
    return {action.dest: values[action.dest] for action in parser._actions
            if action.dest in values and action.default is None}


def run_select(args: argparse.Namespace) -> dict:
    """Capture, statistics and every method for ``args.model``; the result as plain data.

    The capture is keyed by the content digest of the model's files (computed on every call),
    the statistics by the store's content digest: new weights at the same path, or another
    model under the same folder name, never reuse an old store or its statistics."""
    tic = time.perf_counter()
    values = vars(args)
    store = run_capture(build("capture", values, model=args.model, split="analysis"),
                        device=args.device)
    num_layers = store.num_layers
    settings = build("analysis", values)
    config = build("selection", values)
    methods = _methods(config, num_layers, args.method)
    token_sets = {label: _token_set(store, setting, methods, args)
                  for label, setting in settings.items()}
    filtered = list(settings)[1]
    picks = {"top_proxy": _row(token_sets[filtered], config.combined_method)}
    if "eagle3_default" in methods:
        picks["eagle3_default"] = _row(token_sets[filtered], "eagle3_default")
    result = {"model": args.model, "model_digest": store.manifest["model_digest"],
              "store": cache_relative(store.path), "store_digest": store.digest,
              "num_layers": num_layers, "hidden_size": store.hidden_size,
              "k": args.k, "store_tokens": store.n_tokens, "proxy_token_set": filtered,
              "top_proxy_method": config.combined_method,
              "n_subsets": math.comb(num_layers, args.k), "token_sets": token_sets,
              "picks": picks}
    result.update(_recommendation(args, result))
    return {**result, "seconds": time.perf_counter() - tic}


def _recommendation(args: argparse.Namespace, result: dict) -> dict:
    """The study's evidence, the validation (with --validate), the recommended set and its
    engine ids. The EAGLE-3 default unless validation finds a candidate significantly better;
    without a default (k ≠ 3 or N < 7) there is no recommendation and the ids are the
    proxy pick's, marked unvalidated."""
    from actwave.capture.models import slug

    out = {"evidence": [validate.PROXY_NOTE, *validate.study_evidence(slug(args.model))]}
    if args.validate:
        out["validation"] = validate.run_validation(args, result)
        out["recommendation"] = out["validation"]["recommendation"]
    elif "eagle3_default" in result["picks"]:
        out["recommendation"] = {
            "label": "eagle3_default", "layers": result["picks"]["eagle3_default"]["layers"],
            "why": "no validation run: the proxies are no evidence of acceptance "
                   "(--validate trains drafts to test the candidates)"}
    else:
        out["recommendation"] = None
    chosen = out["recommendation"] or result["picks"]["top_proxy"]
    name = "recommended" if out["recommendation"] else "top_proxy (unvalidated)"
    out["engine_ids"] = {name: _engine_ids(chosen["layers"], result["num_layers"],
                                           args.engine or list(ENGINES))}
    return out


def _methods(config: selection_report.SelectionConfig, num_layers: int,
             chosen: list[str] | None) -> dict:
    """The ``chosen`` methods (None: all) plus the top-proxy one and EAGLE-3's default,
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
             f"model files {result['model_digest']} · store <cache>/{result['store']}", ""]
    for label, token_set in result["token_sets"].items():
        lines += _method_table(label, token_set, result) + [""]
    lines += [f"Percentiles: share of all C({result['num_layers']}, {result['k']}) = "
              f"{result['n_subsets']:,} sets of layers 1..N scoring at most as well "
              "(100 = best).", ""]
    names = {"top_proxy": f"top proxy pick ({result['top_proxy_method']})",
             "eagle3_default": "EAGLE-3 default"}
    for name, row in result["picks"].items():
        lines.append(f"{names[name]:<34} {str(tuple(row['layers'])):<14} H2 percentile "
                     f"{row['renyi2_pct']:5.1f} on the {result['proxy_token_set']} tokens")
    lines += [""] + result["evidence"] + [""]
    if "validation" in result:
        lines += validate.format_validation(result["validation"]) + [""]
    return "\n".join(lines + _recommendation_lines(result) + [""] + _engine_table(result))


def _recommendation_lines(result: dict) -> list[str]:
    chosen = result["recommendation"]
    if chosen is None:
        return [f"RECOMMENDATION: none — the EAGLE-3 default needs k = 3 and N ≥ 7; the proxy "
                f"pick {tuple(result['picks']['top_proxy']['layers'])} is not validated"]
    return [f"RECOMMENDATION: {tuple(chosen['layers'])} ({chosen['label']}) — {chosen['why']}"]


def _method_table(label: str, token_set: dict, result: dict) -> list[str]:
    marks = {result["top_proxy_method"]: "*", "eagle3_default": "D"}
    head = f"  {'method':<26}{'layers':<16}" + "".join(f"{t:>15}" for _, t, _ in COLUMNS)
    legend = ("  (* top proxy pick, D EAGLE-3 default)"
              if label == result["proxy_token_set"] else "")
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


def _plan(argv: list[str]) -> int | None:
    from actwave.tools import plan
    return plan.main(argv)


def _run(argv: list[str]) -> int | None:
    from actwave.tools import runplan
    return runplan.main(argv)


def _compare(argv: list[str]) -> int | None:
    from actwave.tools import compare
    return compare.main(argv)


def _train(argv: list[str]) -> int | None:
    from actwave.eagle3 import train
    return train.main(argv)


def _bench(argv: list[str]) -> int | None:
    """benchmarks/run_all.py of this checkout (benchmarks/ is scripts, not a package)."""
    path = repo_root() / "benchmarks" / "run_all.py"
    if not path.is_file():
        raise SystemExit(f"actwave bench: no {path}; run it from a checkout of the repository")
    spec = importlib.util.spec_from_file_location("run_all", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)
    return 0


def _pools(argv: list[str]) -> int | None:
    from actwave.capture import pools
    return pools.main(argv)


def _longrun(argv: list[str]) -> int | None:
    from actwave.study import longrun
    return longrun.main(argv)


# subcommand -> (help, runner of the module's main(argv)); imported on use (startup stays fast)
DELEGATES = {
    "plan": ("what each step of a profile needs: disk, memory, time", _plan),
    "run": ("a profile's notebooks: list them (notebooks) or execute one (run)", _run),
    "compare": ("compare a rerun's tables with the committed ones", _compare),
    "train": ("train one EAGLE-3 draft from a capture store", _train),
    "bench": ("run every benchmark and write the summary table", _bench),
    "pools": ("regenerate (or restore from the pin) a model's on-policy text pools", _pools),
    "longrun": ("the study's long runs: status, or train the missing (set, seed, budget)s", _longrun),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``actwave`` and ``python -m actwave``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv and argv[0] in DELEGATES:
        code = DELEGATES[argv[0]][1](argv[1:])
        return code if isinstance(code, int) else 0
    args = parser.parse_args(argv)
    return _select(parser, args)


def _select(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
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
    for flag, value, low in (("--k", args.k, 1), ("--sequences", args.capture_n_sequences, 1),
                             ("--max-seq-len", args.capture_max_seq_len, 2),
                             ("--batch-size", args.capture_batch_size, 1)):
        if value < low:
            return f"{flag} must be ≥ {low}, got {value}"
    if args.max_tokens != 0 and args.max_tokens < 4:
        return f"--max-tokens must be 0 (all tokens) or ≥ 4, got {args.max_tokens}"
    if not 0.0 <= args.filter_quantile < 1.0:
        return f"--filter-quantile must be in [0, 1), got {args.filter_quantile}"
    return validate.args_problem(args)
