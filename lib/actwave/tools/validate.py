"""What ``select`` may recommend: the study's evidence, and ``select --validate``.

The selection methods score hidden states (information, redundancy); none of them measures
draft acceptance, and the layer-set study (``actwave.study``) found no proxy that ranks trained
drafts. So ``select`` recommends EAGLE-3's default ``(2, N//2, N−3)`` unless trained drafts
show otherwise. ``select --validate`` trains that evidence on the spot, with the study's own
path (``actwave.study.runs.run_draft``: one draft per (set, seed), one budget, offline τ̂ on
held-out regenerated replies) for the default and the top-K distinct candidate sets the
selection methods pick (ranked by their Rényi-2 percentile), and compares each candidate with
the default by the study's paired seed × sequence bootstrap (``actwave.study.stats``).

Decision rule (``RULE``): the recommendation is the default unless a candidate's Δτ̂ = τ̂(set)
− τ̂(default) has a one-sided bootstrap lower bound > 0 under Holm's correction over the K
candidates at family-wise level α (default 0.05): with m candidates not yet rejected, every
candidate whose lower bound at level 1 − α/m is > 0 is rejected (better than the default) and
m shrinks, until none is. Among the candidates found better, the largest Δτ̂ is recommended.

Budget (``default_budget``): the steps from which the study's short-run rankings predict its
long-run one, read from a rank-stability table once the study has one; until then the study
profile's per-draft budget, and the output says the short-run ranking may not predict trained
drafts (``NOT_MEASURED``). Text (``--validate-text``): a budget from the long runs' table is
trained on the long runs' text and schedule (``actwave.tools.validate_long``, which reads
committed long-run records of the same key instead of retraining), any other on the 1×
study's stores; a note says when the steps pass more than twice over the training texts.
Cost (``estimate_cost``, ``validate_long.estimate_cost``): drafts to train × (steps × the
median seconds per step + the median scoring seconds of the committed records of the model),
printed before any training; progress is a tqdm bar over drafts and one per draft.

Records live under ``cache_dir()/validate``, keyed like the study's records (study config,
training config, store hashes; or the long runs' job keys), and the drafts in the cache
under the same keys, so a rerun skips every finished draft.
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from actwave.config import cache_dir, config_hash, results_dir
from actwave.index import cache_relative
from actwave.stats.selection import eagle3_default
from actwave.study import runs, stats as study_stats
from actwave.profile import build, parameters
from actwave.tools import validate_long
from actwave.tools.runplan import load_profile

RULE = ("recommend the EAGLE-3 default unless a candidate's Δτ̂ vs the default has a one-sided "
        "bootstrap lower bound > 0 with Holm's correction over the {k} candidate(s) at "
        "family-wise level α = {alpha} (seed × sequence bootstrap); then the largest such Δτ̂")
NOT_MEASURED = ("rank stability across budgets not yet measured; the short-run ranking may not "
                "predict trained drafts")
PROXY_NOTE = ("The proxies (Rényi-2, log-det, entropy sums, dispersion, CKA) measure the "
              "information and redundancy of the hidden states, not draft acceptance. What "
              "the layer-set study (trained drafts, offline τ̂) found:")
# Fixed rules and random draws: not selections by a proxy, so never candidates.
FIXED_METHODS = ("eagle3_default", "evenly_spaced", "last_k", "first_k", "random")
STUDY_PROFILE = "study"
RANK_STABILITY_GLOB = "*rank_stability*.csv"
DEFAULT_LABEL = "eagle3_default"
# select's top proxy pick on each token set, as the study labels it
TOP_PROXY_LABELS = ("renyi2_exhaustive", "renyi2_exhaustive@filtered")
TEXTS = ("auto", "longrun", "study")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``select``'s --validate options."""
    group = parser.add_argument_group("validation (train short drafts; actwave.tools.validate)")
    group.add_argument("--validate", action="store_true",
                       help="train drafts for the top candidates and the EAGLE-3 default, "
                            "score offline τ̂ on held-out text and recommend by the rule printed")
    group.add_argument("--budget", type=int, default=None,
                       help="training steps per draft (default: the rank-stability table's "
                            "budget, else the study profile's study.train.total_steps)")
    group.add_argument("--seeds", type=int, default=3,
                       help=f"seeds per set (≥ {study_stats.MIN_UNITS}: the bootstrap resamples "
                            "seeds; default 3)")
    group.add_argument("--candidates", type=int, default=3,
                       help="candidate sets to train besides the default (default 3)")
    group.add_argument("--alpha", type=float, default=0.05,
                       help="family-wise error level of the Holm-corrected rule (default 0.05)")
    group.add_argument("--validate-profile", default=STUDY_PROFILE,
                       help="profile whose study data sizes and training settings are used "
                            "(default: study, the layer-set study's)")
    group.add_argument("--validate-text", choices=TEXTS, default="auto",
                       help="what the drafts train and score on: 'longrun', the long runs' "
                            "pools and schedule (actwave.tools.validate_long); 'study', the "
                            "1× study's replies; 'auto' (default): longrun when the budget "
                            "comes from the long runs' rank-stability table, else study")


def args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the --validate options (None if nothing or not validating)."""
    if not args.validate:
        return None
    if args.k != 3:
        return ("--validate compares with the EAGLE-3 default, which has 3 layers: --k 3, "
                f"got {args.k}")
    if args.candidates < 1:
        return f"--candidates must be ≥ 1, got {args.candidates}"
    if args.seeds < study_stats.MIN_UNITS:
        return (f"--seeds must be ≥ {study_stats.MIN_UNITS} (the seed × sequence bootstrap "
                f"needs {study_stats.MIN_UNITS} seeds per set), got {args.seeds}")
    if args.budget is not None and args.budget < 1:
        return f"--budget must be ≥ 1 training step, got {args.budget}"
    if not 0.0 < args.alpha < 0.5:
        return f"--alpha must be in (0, 0.5) (a one-sided error level), got {args.alpha}"
    return None


# ----------------------------------------------------------------------------- the budget
@dataclass
class Budget:
    """Training steps per draft, where they come from and what that means."""

    steps: int
    source: str
    note: str | None = None
    text: str = "study"  # the text the budget was measured on: "longrun" or "study"


def default_budget(slug: str, profile: dict, results: Path | None = None,
                   profile_name: str = STUDY_PROFILE) -> Budget:
    """The budget at which short-run rankings predict long-run ones, for model ``slug``.

    Looked up in the study's rank-stability table (``results/study/*rank_stability*.csv``,
    columns ``model``, ``train_steps``, ``predicts``: the smallest ``train_steps`` of this
    model from which every budget's ``predicts`` is true; the largest budget measured when the
    longest shorter one's is not). Until
    that table exists, the study profile's per-draft budget (``study.train.total_steps`` of
    ``profile``) with ``NOT_MEASURED`` as the note.
    """
    results = Path(results or results_dir(STUDY_PROFILE))
    for table in sorted(results.glob(RANK_STABILITY_GLOB)):
        found = _stable_steps(table, slug)
        if found is not None:
            steps, versus = found
            planned = max(build("longrun", parameters(profile), model=slug).budgets)
            why = (f"the next shorter budget's ranking does not predict the one at {steps} steps" if
                   steps == versus else f"the ranking at {steps} steps predicts the one at "
                   f"{versus or '?'}")
            return Budget(steps, f"{table.name} (rank stability: {why})",
                          _partial_note(versus, planned), text="longrun")
    return Budget(int(profile["study"]["train"]["total_steps"]), f"study.train.total_steps of "
                  f"profiles/{profile_name}.yaml, the study's per-draft budget", NOT_MEASURED)


def _stable_steps(table: Path, slug: str) -> tuple[int, int | None] | None:
    """(the smallest ``train_steps`` of ``slug`` from which every budget's ranking
    ``predicts`` the largest budget's, that budget (``versus``; None in a table without it)),
    or None when the table has no rows of ``slug``. A short budget that predicts while a
    longer one does not (a chance agreement of six sets) is not taken: rankings have not
    settled there. Where the longest shorter budget does not predict, (largest, largest): a
    shorter run is not known to rank like the longest one measured. Rows of one seed
    (``seeds`` other than "all": notebook 12's seed-0 rows) are not used."""
    with table.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("model") == slug
                and r.get("seeds", "all") in ("all", "")]
    verdicts = [r for r in rows if str(r.get("predicts", "")).strip()]  # not "next budget"
    settled = []
    for row in sorted(verdicts, key=lambda r: int(float(r["train_steps"])), reverse=True):
        if str(row["predicts"]).strip().lower() not in ("true", "1", "yes"):
            break
        settled.append(row)
    if settled:
        best = settled[-1]
        versus = best.get("versus")
        return int(float(best["train_steps"])), int(float(versus)) if versus else None
    largest = [int(float(r["versus"])) for r in rows if r.get("versus")]
    return (max(largest), max(largest)) if largest else None


def _partial_note(versus: int | None, planned: int) -> str | None:
    """Say so while the long runs have not reached their largest planned budget (``planned``,
    the profile's ``longrun`` section): the ranking is then checked against drafts that are
    still learning."""
    if versus is not None and versus >= planned:
        return None
    return (f"rank stability so far measured only up to {versus or '?'} steps of the planned "
            f"{planned}: the short-run ranking may not predict converged drafts")


def _passes_note(steps: int, batch: int | None, n_texts: int | None) -> str | None:
    """Say so when ``steps`` of ``batch`` sequences repeat the ``n_texts`` training texts more
    than twice: the long runs that set the table's budget see each conversation of their
    pool about once, and drafts that pass over few texts many times may rank by memorising."""
    if not n_texts or not batch or steps * batch <= 2 * n_texts:
        return None
    return (f"{steps} steps × batch {batch} pass {steps * batch / n_texts:.0f} times over the "
            f"{n_texts} training texts, where the long runs that set the table's budget saw "
            "theirs ~1 time: these drafts may rank by memorising; --budget sets fewer steps, "
            "--validate-text longrun trains on the long runs' pool")


# ----------------------------------------------------------------------------- the sets
def candidate_sets(select_result: dict, n: int) -> list[dict]:
    """The top ``n`` distinct sets the selection methods picked (not the default), ranked by
    Rényi-2 percentile on their token set (ties: the proxy token set first, then the
    methods' order).

    -> [{"label", "layers", "renyi2_pct", "picked_by": ["method@token set", ...]}].
    """
    default = list(eagle3_default(select_result["num_layers"]))
    found: dict[tuple, dict] = {}
    for token_set, entry in _token_sets_first(select_result):
        for row in entry["methods"]:
            if row["method"] in FIXED_METHODS or list(row["layers"]) == default:
                continue
            item = found.setdefault(tuple(row["layers"]), {
                "label": set_label(row["layers"]), "layers": list(row["layers"]),
                "renyi2_pct": -math.inf, "picked_by": []})
            item["picked_by"].append(f"{row['label']}@{token_set}")
            item["renyi2_pct"] = max(item["renyi2_pct"], _finite(row["renyi2_pct"]))
    # sorted() is stable: equal percentiles keep the order they were found in
    return sorted(found.values(), key=lambda item: -item["renyi2_pct"])[:n]


def _token_sets_first(select_result: dict) -> list[tuple[str, dict]]:
    """The token sets, the one of the top proxy pick (top-entropy tokens) first."""
    first = select_result["proxy_token_set"]
    return sorted(select_result["token_sets"].items(), key=lambda item: item[0] != first)


def _finite(value: float) -> float:
    return -math.inf if value is None or math.isnan(value) else float(value)


def set_label(layers) -> str:
    """Record label of a layer set: ``layers_11-28-29``."""
    return "layers_" + "-".join(str(int(v)) for v in layers)


# ----------------------------------------------------------------------------- the config
def study_config(model: str, profile: dict, steps: int) -> runs.StudyConfig:
    """The study's data and training settings (the ``study`` section of ``profile``, as
    notebook 08 builds them) at ``steps``.

    Set-choice fields are fixed (n_seeds=1, n_random=0, extra_k="", curve_factor=1) so the
    record keys depend only on data, training and scoring: --seeds or --candidates can grow
    and a rerun keeps every finished draft.
    """
    config = build("study", parameters(profile), model=model)
    train = replace(config.train, total_steps=steps,
                    warmup_steps=min(config.train.warmup_steps, steps),
                    checkpoint_every=min(config.train.checkpoint_every, steps))
    return replace(config, train=train, n_random=0, n_seeds=1, extra_k="", curve_factor=1)


def records_dir(slug: str, config: runs.StudyConfig) -> Path:
    """Where this model's validation records live: one folder per study config (named by
    its flat layout, as the records are keyed: folders made before the nested config stay)."""
    return cache_dir() / "validate" / f"{slug}-{config_hash(config.flat())}"


# ----------------------------------------------------------------------------- the cost
def estimate_cost(slug: str, steps: int, n_drafts: int, results: Path | None = None) -> dict:
    """Predicted seconds of ``n_drafts`` drafts of ``steps`` steps: steps × the median
    seconds/step of the study's committed records of this model, plus their median scoring
    seconds. -> {"seconds" (NaN without records), "source"}.
    """
    records = _study_records(slug, results)
    if not records:
        return {"seconds": math.nan, "source": f"no study records of {slug} to time it: see "
                                                "the drafts bar's ETA after the first draft"}
    per_step = statistics.median(r["train_seconds"] / r["train"]["total_steps"] for r in records)
    scoring = statistics.median(max(r["wall_seconds"] - r["train_seconds"], 0.0) for r in records)
    return {"seconds": n_drafts * (steps * per_step + scoring),
            "source": f"{per_step:.2f} s/step + {scoring:.0f} s scoring per draft, medians of "
                      f"{len(records)} study drafts of {slug}"}


def _study_records(slug: str, results: Path | None) -> list[dict]:
    folder = Path(results or results_dir(STUDY_PROFILE)) / slug
    return [r for r in runs.load_records(folder) if r.get("steps_factor", 1) == 1]


# ----------------------------------------------------------------------------- training
def prepare(config: runs.StudyConfig, slug: str, device: str, profile_name: str):
    """The target and the study's train / eval stores (regenerated text restored, read-only,
    from ``results/<profile>/<slug>/regenerated`` when pinned there). -> (target, stores)."""
    from actwave.capture import models as model_zoo
    from actwave.capture import regenerate
    from actwave.capture.models import DTYPES
    from actwave.capture.store import regen_config, run_capture

    target, tokenizer = model_zoo.load(config.model, dtype=DTYPES[config.capture.dtype],
                                       device=device)
    pinned = results_dir(profile_name) / slug / "regenerated"
    stores = {}
    for split in ("train", "eval"):
        capture = config.capture_for(split)
        if pinned.is_dir():
            regenerate.restore(regen_config(capture), pinned)
        stores[split] = run_capture(capture, target, tokenizer, device=device)
    return target, stores


def train_sets(sets: list[runs.StudySet], n_seeds: int, config: runs.StudyConfig, target,
               stores: dict, folder: Path) -> dict[str, list[dict]]:
    """One record per (set, seed), first seeds of every set first; finished ones are read.

    -> {label: [record per seed]}.
    """
    order = [(s, seed) for seed in range(n_seeds) for s in sets]
    records: dict[str, list[dict]] = {s.label: [] for s in sets}
    for study_set, seed in tqdm(order, desc="validation drafts", unit="draft"):
        record = runs.run_draft(study_set, config.seed + seed, config, target, stores, folder,
                                progress=True)
        records[study_set.label].append(record)
    return records


# ----------------------------------------------------------------------------- the decision
def compare(records: dict[str, list[dict]], alpha: float, n_bootstrap: int = 2000,
            seed: int = 0) -> list[dict]:
    """Each candidate vs the default: τ̂, Δτ̂ with the study's 95% CI, and Holm's verdict.

    records: {label: [record per seed]}, ``DEFAULT_LABEL`` among them. -> one row per
    candidate: {"label", "layers", "tau_hat", "diff", "ci_low", "ci_high", "holm_level",
    "holm_lower", "better"}; ``holm_lower`` is the one-sided lower bound at the level Holm's
    procedure last tested the candidate at (1 − α/m).
    """
    reference = records[DEFAULT_LABEL]
    rows = {}
    for label, arm in records.items():
        if label != DEFAULT_LABEL:
            diff = study_stats.paired_difference(arm, reference, n_bootstrap, seed)
            rows[label] = {"label": label, "layers": list(arm[0]["layer_ids"]),
                           "tau_hat": float(study_stats.seed_taus(arm).mean()),
                           **{key: diff[key] for key in ("diff", "ci_low", "ci_high")}}
    _holm(rows, records, alpha, n_bootstrap, seed)
    return sorted(rows.values(), key=lambda row: -row["diff"])


def _holm(rows: dict, records: dict, alpha: float, n_bootstrap: int, seed: int) -> None:
    """Holm's step-down on one-sided lower bounds: with m candidates left, reject (mark
    ``better``) each whose lower bound at 1 − α/m is > 0; repeat with the rest until none."""
    left = dict(rows)
    while left:
        level = 1 - alpha / len(left)
        for label, row in left.items():
            two_sided = 1 - 2 * (1 - level)  # its lower quantile is the one-sided bound
            bound = study_stats.paired_difference(records[label], records[DEFAULT_LABEL],
                                                  n_bootstrap, seed, level=two_sided)
            row.update(holm_level=level, holm_lower=bound["ci_low"])
            row["better"] = bool(bound["ci_low"] > 0)
        rejected = [label for label, row in left.items() if row["better"]]
        if not rejected:
            return
        for label in rejected:
            del left[label]


def recommend(rows: list[dict], default_layers) -> dict:
    """The rule's choice: the best candidate found better, else the default."""
    better = [row for row in rows if row["better"]]
    if not better:
        return {"label": DEFAULT_LABEL, "layers": list(default_layers),
                "why": "no candidate is significantly better than the EAGLE-3 default"}
    best = max(better, key=lambda row: row["diff"])
    return {"label": best["label"], "layers": best["layers"],
            "why": f"Δτ̂ {best['diff']:+.4f}, Holm lower bound {best['holm_lower']:+.4f} > 0"}


def run_validation(args: argparse.Namespace, select_result: dict) -> dict:
    """``select --validate``: budget, text, cost, drafts, comparison and the recommendation."""
    from actwave.capture import models as model_zoo

    started = time.perf_counter()
    slug = model_zoo.slug(args.model)
    profile = load_profile(args.validate_profile)
    budget = (Budget(args.budget, "--budget") if args.budget is not None
              else default_budget(slug, profile, profile_name=args.validate_profile))
    text = budget.text if args.validate_text == "auto" else args.validate_text
    candidates = candidate_sets(select_result, args.candidates)
    default = eagle3_default(select_result["num_layers"])
    sets = [runs.StudySet(DEFAULT_LABEL, default, "default", args.seeds)] + [
        runs.StudySet(c["label"], tuple(c["layers"]), "selected", args.seeds) for c in candidates]
    train = _train_on_long_text if text == "longrun" else _train_on_study_text
    records, described, folder = train(args, profile, budget, sets)
    rows = compare(records, args.alpha, seed=args.seed)
    for row in rows:
        row["picked_by"] = next(c["picked_by"] for c in candidates if c["label"] == row["label"])
    return {"budget": asdict(budget), "text": described, "seeds": args.seeds,
            "alpha": args.alpha, "rule": RULE.format(k=len(candidates), alpha=args.alpha),
            "default": {"layers": list(default),
                        "tau_hat": float(study_stats.seed_taus(records[DEFAULT_LABEL]).mean())},
            "rows": rows, "recommendation": recommend(rows, default),
            "wall_seconds": time.perf_counter() - started,  # capture + drafts + scoring
            # relative, so a committed JSON names no machine's paths
            "records_dir": f"<cache>/{cache_relative(folder)}"}


def _train_on_study_text(args, profile: dict, budget: Budget, sets) -> tuple[dict, dict, Path]:
    """The 1× study's path: its stores and ``runs.run_draft``. -> (records, text, folder)."""
    from actwave.capture import models as model_zoo

    slug = model_zoo.slug(args.model)
    config = study_config(args.model, profile, budget.steps)
    n_texts = config.capture.n_sequences
    described = {"kind": "study", "train_texts": n_texts, "cost": estimate_cost(
        slug, budget.steps, len(sets) * args.seeds), "note": _passes_note(
        budget.steps, config.train.batch_size, n_texts)}
    print(_plan_line(budget, described, len(sets), args.seeds), flush=True)
    target, stores = prepare(config, slug, args.device, args.validate_profile)
    folder = records_dir(slug, config)
    return train_sets(sets, args.seeds, config, target, stores, folder), described, folder


def _train_on_long_text(args, profile: dict, budget: Budget, sets) -> tuple[dict, dict, Path]:
    """The long runs' path (``validate_long``). -> (records, text, folder)."""
    from actwave.study.longrun import results_folder

    text = validate_long.long_text(args.model, profile, args.validate_profile)
    committed = results_folder(args.model, results_dir(STUDY_PROFILE))
    run = validate_long.plan(args.model, text, sets, args.seeds, budget.steps, committed)
    described = {"kind": "longrun", "train_texts": text.n_train, "eval_texts": text.n_eval,
                 "longrun": asdict(text.config),
                 "reused": sorted(r["reused_from"] for r in run.found.values()
                                  if "reused_from" in r),
                 "cost": validate_long.estimate_cost(run, committed),
                 "note": _passes_note(budget.steps, text.config.batch_size, text.n_train)}
    print(_plan_line(budget, described, len(sets), args.seeds), flush=True)
    return validate_long.train(run, sets), described, run.folder


def _plan_line(budget: Budget, text: dict, n_sets: int, seeds: int) -> str:
    seconds = text["cost"]["seconds"]
    when = "unknown" if math.isnan(seconds) else f"≈ {seconds / 60:.0f} min"
    lines = [f"validation: {n_sets} sets × {seeds} seeds = {n_sets * seeds} drafts of "
             f"{budget.steps} steps ({budget.source}) on {_text_words(text)}; predicted cost "
             f"{when} ({text['cost']['source']}; plus the train/eval capture when not cached; "
             "finished drafts are read, not retrained)"]
    notes = [note for note in (budget.note, text["note"]) if note]
    return "\n".join(lines + [f"  note: {note}" for note in notes])


def _text_words(text: dict) -> str:
    """What the drafts trained on, in words."""
    if text["kind"] == "longrun":
        return (f"the long runs' text ({text['train_texts']} train-pool conversations, "
                f"{text['eval_texts']} held-out; warmup-stable-decay)")
    return f"the 1× study's text ({text['train_texts']} regenerated replies)"


# ----------------------------------------------------------------------------- reporting
def format_validation(validation: dict) -> list[str]:
    """The printed validation table and decision."""
    default = validation["default"]
    text = validation.get("text") or {"kind": "study", "train_texts": "?", "note": None}
    lines = [f"validation: {validation['budget']['steps']} steps per draft "
             f"({validation['budget']['source']}), {validation['seeds']} seeds per set, "
             f"trained on {_text_words(text)}, offline τ̂ on held-out regenerated replies",
             f"  {'set':<24}{'layers':<16}{'τ̂':>8}{'Δτ̂':>10}{'95% CI':>22}"
             f"{'Holm bound':>12}  better  picked by",
             f"  {'EAGLE-3 default':<24}{str(tuple(default['layers'])):<16}"
             f"{default['tau_hat']:>8.4f}"]
    for row in validation["rows"]:
        ci = f"[{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]"
        lines.append(f"  {row['label']:<24}{str(tuple(row['layers'])):<16}{row['tau_hat']:>8.4f}"
                     f"{row['diff']:>+10.4f}{ci:>22}{row['holm_lower']:>+12.4f}  "
                     f"{'yes' if row['better'] else 'no':<8}{', '.join(row.get('picked_by', []))}")
    for note in (validation["budget"].get("note"), text.get("note")):
        if note:
            lines.append(f"  note: {note}")
    if text.get("reused"):
        lines.append(f"  read from the committed long-run records: {', '.join(text['reused'])}")
    if "wall_seconds" in validation:
        lines.append(f"  wall time {validation['wall_seconds'] / 60:.1f} min (capture, training "
                     "and scoring; drafts already in the cache are read, not retrained)")
    return lines + [f"  rule: {validation['rule']}",
                    f"  -> {tuple(validation['recommendation']['layers'])}: "
                    f"{validation['recommendation']['why']}"]


def study_evidence(slug: str, results: Path | None = None) -> list[str]:
    """What the committed study found, read from its tables at run time: each set of
    the study's entropy method vs the default, and the proxies' rank correlations with
    trained drafts. For a model outside the study: every bundled model's result."""
    results = Path(results or results_dir(STUDY_PROFILE))
    tables = sorted(results.glob("10_sets_vs_default_*.csv"))
    if not tables:
        return [f"No committed study tables (10_sets_vs_default_*.csv) under {results}."]
    own = [t for t in tables if t.stem.endswith(f"_{slug}")]
    lines = [] if own else [f"The study has no result for {slug}; it found, for the bundled "
                            "models:"]
    for table in own or tables:
        lines += _sets_vs_default(table)
    for table in sorted(results.glob(f"12_study_long_sets_{slug if own else '*'}.csv")):
        lines += _long_runs(table)
    return lines + _proxy_correlations(results / "10_proxy_correlations.csv")


def _sets_vs_default(table: Path) -> list[str]:
    """The study's Rényi-2 picks (``select``'s top proxy) vs the default in one model's table."""
    with table.open() as f:
        rows = list(csv.DictReader(f))
    model = table.stem.removeprefix("10_sets_vs_default_")
    default = next(r for r in rows if r["label"] == DEFAULT_LABEL)
    lines = [f"  {model} ({table.relative_to(table.parents[2])}): EAGLE-3 default "
             f"({default['layer_ids']}) τ̂ {float(default['tau_hat']):.4f}, "
             f"{default['n_seeds']} seeds"]
    names = _study_names(table.parent / f"08_sets_{model}.csv", TOP_PROXY_LABELS)
    for row in rows:
        if row["label"] in names:
            lines.append(f"    {names[row['label']]} ({row['layer_ids']}): Δτ̂ "
                         f"{float(row['vs_default_diff']):+.4f} {_ci(row)}")
    return lines


def _long_runs(table: Path) -> list[str]:
    """The long runs (notebook 12) at the largest budget whose every set has its seed × sequence
    CI (enough seeds; a budget under way has not): the default's τ̂ and every set's Δτ̂ vs it
    with that CI and the Holm-adjusted p."""
    with table.open() as f:
        rows = list(csv.DictReader(f))
    compared = defaultdict(list)
    for row in rows:
        compared[int(row["budget"])].append(row)
    done = [budget for budget, group in compared.items()
            if any(r["label"] == DEFAULT_LABEL for r in group) and len(group) > 1
            and all(r["ci_low"] for r in group if r["label"] != DEFAULT_LABEL)]
    if not done:
        return []
    budget = max(done)
    rows = compared[budget]
    default = next(r for r in rows if r["label"] == DEFAULT_LABEL)
    model = table.stem.removeprefix("12_study_long_sets_")
    lines = [f"  {model}, long runs at {budget} steps ({table.relative_to(table.parents[2])}): "
             f"EAGLE-3 default τ̂ {float(default['tau_hat']):.4f}, {default['n_seeds']} seeds"]
    for row in sorted((r for r in rows if r["diff"]), key=lambda r: -float(r["diff"])):
        lines.append(f"    {row['label']}: Δτ̂ {float(row['diff']):+.4f} [95% CI "
                     f"{float(row['ci_low']):+.4f}, {float(row['ci_high']):+.4f}], "
                     + (f"p {float(row['p']):.3f} (the primary comparison, unadjusted)"
                        if row.get("primary") == "True" else f"Holm p {float(row['p_holm']):.3f}"))
    return lines


def _study_names(sets_table: Path, wanted) -> dict[str, str]:
    """{study label: the ``wanted`` name it carries}: a set picked by several methods is
    trained once under its first label, the others are its aliases (08_sets table)."""
    if not sets_table.exists():
        return {name: name for name in wanted}
    with sets_table.open() as f:
        rows = list(csv.DictReader(f))
    out = {}
    for row in rows:
        names = [row["label"], *filter(None, row.get("aliases", "").split(","))]
        for name in (n for n in names if n in wanted):
            out[row["label"]] = name if name == row["label"] else f"{name} (= {row['label']})"
    return out


def _ci(row: dict) -> str:
    """The hierarchical 95% CI, or the sequence-only one (flagged) where seeds were too few."""
    if row["vs_default_ci_low"]:
        return (f"[95% CI {float(row['vs_default_ci_low']):+.4f}, "
                f"{float(row['vs_default_ci_high']):+.4f}]")
    return (f"[sequence-only 95% CI {float(row['vs_default_seq_ci_low']):+.4f}, "
            f"{float(row['vs_default_seq_ci_high']):+.4f}; {row['n_seeds']} seed(s)]")


def _proxy_correlations(table: Path) -> list[str]:
    """Per model: the range of proxy-vs-τ̂ Spearman ρ and the smallest Holm-adjusted p."""
    if not table.exists():
        return []
    with table.open() as f:
        rows = list(csv.DictReader(f))
    lines = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        rho = [float(r["spearman"]) for r in mine]
        best = min(mine, key=lambda r: float(r["spearman_p"]))
        adjusted = min(1.0, len(mine) * float(best["spearman_p"]))
        verdict = ("no proxy ranks trained drafts" if adjusted >= 0.05 else
                   f"{best['proxy']} ({best['token_set']} tokens) ranks trained drafts")
        lines.append(f"  {model}: {verdict} — proxy vs τ̂ over {best['n']} sets: Spearman ρ "
                     f"{min(rho):+.2f} to {max(rho):+.2f}, smallest Holm-adjusted p "
                     f"{adjusted:.2f} ({best['proxy']}, {best['token_set']} tokens; "
                     f"{len(mine)} tests)")
    return lines
