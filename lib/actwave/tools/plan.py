"""A plan before the run: what each step of a profile will need, from the model's config alone.

    actwave plan [--model ID] [--profile cpu] [--memory-gib G] [--device-memory-gib G]
        [--disk-gib G] [--stats-route all_pairs|block_pairs] [--stats-budget-gib G]
        [--rates results/benchmarks/summary.csv]

``ID`` is a bundled name, a local model folder, an HF id in the local HF cache, or a
``config.json``-style file (e.g. ``profiles/configs/llama-3.1-8b.json``); without ``--model``
the plan covers each of the profile's ``models``. The model is built
on the meta device (no weights) for its parameter count. The plan prints, per step, the
capture disk, the layer-statistics memory of each route, the draft-training memory, and
times scaled from committed measurements (named in the output) — notebooks 01-07 and the
layer-set study's 08-11 (``study_needs``) — then refuses — exit status
2, one line naming the setting to change — a run whose disk or memory cannot fit.
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from actwave.config import cache_dir, repo_root
from actwave.stats.analysis import available_bytes
from actwave.stats.blockstats import pair_schedule, peak_bytes
from actwave.stats.layerstats import StreamingLayerStats
from actwave.profile import build, parameters, section
from actwave.tools.costs import (LONGRUN_FILL, RATE_SOURCES, SHAREGPT_FILL, Shape,
                                 draft_train_bytes, draft_train_flops_per_token, model_shape,
                                 read_rates)
from actwave.tools.runplan import Refusal, load_profile

GIB = 2**30
# Mean stored tokens per sequence / max_seq_len, measured: 30,259 tokens in 64 SmolLM2
# analysis sequences of ≤ 512 (results/cpu/01_capture.csv).
FILL = 30259 / (64 * 512)
COLUMN_BYTES = 39  # per-token columns of a store (35,751 B/token measured − 31·576·2)
STAT_SETS = 3  # token sets notebook 02 caches per model: all, top-entropy, all + special


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f} GiB" if value >= GIB / 10 else f"{value / 2**20:,.1f} MiB"


def _time(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:,.1f} h"


@dataclass
class Limits:
    """What the machine offers: host memory, accelerator memory, free disk (bytes)."""

    host: float
    device: float
    disk: float


@dataclass
class Need:
    """One line of the plan: a step, what it needs, its estimated time, and — when it does not
    fit — which limit it exceeds and the setting that changes it."""

    step: str
    detail: str
    seconds: float | None = None
    bytes_needed: float = 0.0
    limit: str = ""         # "host" | "device" | "disk" | "" (not checked)
    setting: str = ""


def _tokens(sequences: int, max_seq_len: int) -> int:
    return round(sequences * max_seq_len * FILL)


def capture_needs(shape: Shape, p: dict, rates: dict, train: bool) -> list[Need]:
    """Notebook 01: the analysis store (section ``capture``), and for a draft model the train
    store (``train_capture``, after regenerating its replies when its source is 'regenerated')."""
    per_token = (shape.layers + 1) * shape.dim * 2 + COLUMN_BYTES
    sections = [("analysis", section(p, "capture"), "capture")]
    needs = []
    if train:
        capture = section(p, "train_capture")
        sections.append(("train", capture, "train_capture"))
        if capture.get("source") == "regenerated":
            new = capture["n_sequences"] * capture["regen_new_tokens"]
            needs.append(Need("01 regenerate train replies", f"{capture['n_sequences']} replies "
                              f"× ≤ {capture['regen_new_tokens']} tokens",
                              new * shape.forward_flops / rates["regenerate"]))
    for split, capture, name in sections:
        sequences, length = capture["n_sequences"], capture["max_seq_len"]
        tokens = _tokens(sequences, length)
        needs.append(Need(f"01 capture {split} store",
                          f"{sequences} seqs × ≤ {length} ≈ {tokens:,} tokens × "
                          f"{per_token / 1e3:.1f} kB", tokens * shape.forward_flops / rates["capture"],
                          tokens * per_token, "disk", f"{name}.n_sequences or {name}.max_seq_len"))
    return needs


def stats_needs(shape: Shape, p: dict, rates: dict, route: str, budget: float,
                where: str) -> list[Need]:
    """Notebooks 02-05: per token set one pass (all-pairs) or several (block-pairs)."""
    L, d = shape.layers + 1, shape.dim
    tokens = _tokens(int(p["capture_n_sequences"]), int(p["capture_max_seq_len"]))
    seconds = 2.5 * tokens * L * (L + 1) * d * d / rates["stats"]  # sets: all, top half, all+sp.
    all_pairs = StreamingLayerStats.accumulator_bytes(L, d)
    minimum = peak_bytes(L, d, _block_minimum(L, d))
    setting = ("the statistics route: compute_layer_stats(..., route='block_pairs', "
               "memory_budget=...) (plan: --stats-route block_pairs)")
    runs = route == "all_pairs"
    lines = [Need("02 statistics, all_pairs route", f"L(L+1)/2·d²·8 on {where}" +
                  ("" if runs else " (not run)"), seconds if runs else None, all_pairs,
                  where if runs else "", setting)]
    if runs:
        lines.append(Need("02 cached statistics", f"{STAT_SETS} token sets × the blocks", None,
                          STAT_SETS * all_pairs, "disk", setting))
    else:
        passes = len(pair_schedule(L, d, int(budget)))
        lines.append(Need("02 statistics, block_pairs route",
                          f"budget {_gib(budget)}: {passes} passes over the store per token set "
                          f"(minimum budget {_gib(minimum)}: {L * (L + 1) // 2} passes); no "
                          "Shannon aggregates", seconds, peak_bytes(L, d, int(budget)), where,
                          "memory_budget (plan: --stats-budget-gib)"))
    return lines


def _block_minimum(L: int, d: int) -> int:
    from actwave.stats.blockstats import fixed_bytes
    return fixed_bytes(L, d) + 8 * d * d


def train_needs(shape: Shape, p: dict, rates: dict, where: str, n_drafts: int) -> list[Need]:
    """Notebook 06: the train split's k+1 layers in host memory, then one draft at a time."""
    k, t = int(p["k"]), section(p, "train")
    seq, batch = t["max_seq_len"], t["batch_size"]
    tokens = _tokens(int(p["train_capture_n_sequences"]), int(p["train_capture_max_seq_len"]))
    data = tokens * (k + 1) * shape.dim * 2
    parts = draft_train_bytes(shape, k, t["draft_vocab_size"], t["ttt_steps"], batch, seq, 4)
    per_draft = t["total_steps"] * batch * seq * FILL
    flops = per_draft * draft_train_flops_per_token(shape, k, t["draft_vocab_size"],
                                                    t["ttt_steps"], seq)
    detail = ", ".join(f"{name} {_gib(value)}" for name, value in parts.items())
    return [Need("06 train states in memory", f"{tokens:,} tokens × {k + 1} layers × d × 2 B",
                 None, data, "host", "train_capture.n_sequences"),
            Need(f"06 train {n_drafts} drafts", f"per draft {t['total_steps']} steps × "
                 f"{batch} × {seq}: {detail}", n_drafts * flops / rates["train"],
                 sum(parts.values()), where,
                 "train.batch_size, train.max_seq_len or train.draft_vocab_size")]


def eval_needs(shape: Shape, p: dict, rates: dict, n_methods: int = 7,
               passes: int = 2, baselines: int = 2) -> list[Need]:
    """Notebook 07: every method generates on every prompt of every benchmark, once per pass
    (the fixed tree and the auto shape), plus the HF baselines once."""
    benchmarks = len(str(p["benchmarks"]).split(","))
    decodes = passes * n_methods + baselines
    tokens = (decodes * benchmarks * int(p["n_prompts"]) * int(p["max_turns"])
              * int(p["max_new_tokens"]))
    return [Need("07 speculative evaluation", f"({passes} passes × {n_methods} methods + "
                 f"{baselines} HF) × {benchmarks} benchmarks × {p['n_prompts']} prompts × "
                 f"{p['max_turns']} turns × {p['max_new_tokens']} tokens",
                 tokens * shape.forward_flops / rates["eval"])]


def study_drafts(p: dict, extra_k: bool) -> int:
    """Drafts notebook 08 trains for one model, at most (sets that coincide train once):
    the default, every method's pick on both token sets, three baselines, ``n_random``
    random sets, two per extra k; ``n_seeds`` for the default and the two best picks."""
    from actwave.stats.selection import METHODS
    from actwave.study.runs import SETTINGS, SKIPPED_METHODS
    skipped = {*SKIPPED_METHODS, "last_k", "evenly_spaced", "first_k"}
    picks = len(SETTINGS) * len(set(METHODS) - skipped)
    sizes = [k for k in str(p["extra_k"]).split(",") if k.strip()] if extra_k else []
    sets = 1 + picks + 3 + int(p["n_random"]) + 2 * len(sizes)
    return sets + 3 * (int(p["n_seeds"]) - 1)


def study_needs(shape: Shape, p: dict, rates: dict, where: str, extra_k: bool) -> list[Need]:
    """Notebooks 08-11 of the layer-set study for one model, from the study profile's keys."""
    per_token = (shape.layers + 1) * shape.dim * 2 + COLUMN_BYTES
    study = section(p, "study")
    capture, train = study["capture"], study["train"]
    splits = {"train": capture.n_sequences, "eval": study["eval_sequences"]}
    sizes = {"train": "study.capture.n_sequences", "eval": "study.eval_sequences"}
    seq, new = capture.max_seq_len, capture.regen_new_tokens
    needs = [Need("08 regenerate train + eval replies",
                  f"{sum(splits.values())} replies × ≤ {new} tokens",
                  sum(splits.values()) * new * shape.forward_flops / rates["regenerate"])]
    for split, sequences in splits.items():
        tokens = _tokens(sequences, seq)
        needs.append(Need(f"08 capture {split} store", f"{sequences} seqs × ≤ {seq} ≈ "
                          f"{tokens:,} tokens × {per_token / 1e3:.1f} kB",
                          tokens * shape.forward_flops / rates["capture"], tokens * per_token,
                          "disk", f"{sizes[split]} or study.capture.max_seq_len"))
    drafts, steps, batch = study_drafts(p, extra_k), train.total_steps, train.batch_size
    runs = drafts * steps + study["curve_factor"] * steps  # + the default's learning curve
    vocab, ttt = train.draft_vocab_size, train.ttt_steps
    flops = draft_train_flops_per_token(shape, 3, vocab, ttt, seq)
    parts = draft_train_bytes(shape, 3, vocab, ttt, batch, seq, 4)
    needs.append(Need(f"08 train ≤ {drafts} drafts + curve",
                      f"{steps} steps × {batch} × ≤ {seq} each, the default's curve "
                      f"{study['curve_factor']}× as long",
                      runs * batch * seq * FILL * flops / rates["train"], sum(parts.values()),
                      where, "study.train.batch_size, study.train.max_seq_len or "
                      "study.train.draft_vocab_size"))
    report = Need("10 study report", "reads the records of 08-09; permutation tests", None)
    return needs + decode_needs(shape, p, rates) + [report] + sensitivity_needs(shape, p, rates)


def decode_needs(shape: Shape, p: dict, rates: dict, n_methods: int = 4,
                 passes: int = 2) -> list[Need]:
    """Notebook 09: speculative decoding of every benchmark reply (MT-bench: max_turns), once
    with the chain of depth K and once with the auto shape (``fastpath.compare``)."""
    turns = sum(int(p["max_turns"]) if name == "mtbench" else 1
                for name in str(p["benchmarks"]).split(","))
    replies = turns * int(p["n_prompts"])
    tokens = passes * n_methods * replies * int(p["max_new_tokens"])
    return [Need("09 decoding check", f"{passes} passes × {n_methods} methods × {replies} "
                 f"replies × {p['max_new_tokens']} tokens",
                 tokens * shape.forward_flops / rates["decode"])]


def sensitivity_needs(shape: Shape, p: dict, rates: dict) -> list[Need]:
    """Notebook 11: one statistics pass per token-filter variant (the kept share 1 − q of the
    analysis tokens), and the compartment bootstrap's CKA Grams on ≤ ``boot_tokens``."""
    L, d = shape.layers + 1, shape.dim
    tokens = _tokens(int(p["capture_n_sequences"]), int(p["capture_max_seq_len"]))
    quantiles = [float(q) for key in ("sensitivity_quantiles", "normalized_quantiles")
                 for q in str(p[key]).split(",")]
    kept = sum(1 - q for q in quantiles)
    n, boots = int(p["boot_tokens"]), int(p["n_boot"])
    gram_flops = boots * (2 * L * n * n * d + 2 * L * L * n * n)
    return [Need("11 filter variants", f"{len(quantiles)} statistics passes over "
                 f"{kept:.2f} × {tokens:,} tokens", kept * tokens * L * (L + 1) * d * d / rates["stats"]),
            Need("11 compartment bootstrap", f"{boots} replicates × ≤ {n:,} tokens (CKA Grams)",
                 gram_flops / rates["stats"])]


KEY_SETS = 6           # the pre-registered sets (actwave.study.keysets.key_sets)


def longrun_needs(shape: Shape, p: dict, rates: dict) -> list[Need]:
    """Notebook 12: the target's features of the train and held-out text once (a forward
    over each pool), one WSD run per (set, seed) trained from them (the draft's forward and
    backward only), and one offline scoring per scored budget (the draft's unroll only,
    ~1/3 of a training step's FLOPs per token). The text is the model's regenerated pools
    (``capture.pools``) when it has them, else ShareGPT's longer original replies."""
    from actwave.capture.pools import pool_configs
    from actwave.eagle3.schedule import cost

    config = build("longrun", p, model=shape.name)
    budgets, seq = config.budgets, config.max_seq_len
    steps = cost(config.schedule())["wsd"]
    named = [x for x in str(p.get("longrun_sets", "")).split(",") if x.strip()]
    runs = (len(named) if named and named != ["all"] else KEY_SETS) * int(p["longrun_seeds"])
    fill = seq * (LONGRUN_FILL if Path(shape.name).stem in pool_configs() else SHAREGPT_FILL)
    pools = (int(p["longrun_train_conversations"]) + int(p["longrun_eval_conversations"])) * fill
    draft = draft_train_flops_per_token(shape, 3, config.draft_vocab_size, config.ttt_steps, seq)
    tokens = runs * steps * config.batch_size * fill
    scored = runs * len(budgets) * int(p["longrun_eval_conversations"]) * fill
    return [Need("12 long runs: target features", f"one target forward over {pools:,.0f} tokens "
                 "(train and held-out pools)", pools * shape.forward_flops / rates["capture"]),
            Need(f"12 long runs: {runs} (set, seed) × {steps} steps",
                 f"budgets {budgets}, decayed branches of one WSD run each (from the features)",
                 tokens * draft / rates["longrun_train"]),
            Need("12 long runs: scoring", f"{runs * len(budgets)} records × "
                 f"{p['longrun_eval_conversations']} held-out sequences",
                 scored * draft / 3 / rates["longrun_score"])]


def plan_needs(shape: Shape, profile: dict, rates: dict, route: str, budget: float,
               train: bool = True) -> list[Need]:
    """Every step of the profile's notebooks for one model: 01-07 (``train``: the model is a
    draft target of 06) and the study's 08-11."""
    notebooks = str(profile.get("notebooks", "01,02,03,04,05,06,07"))
    where = "device" if str(profile.get("device", "cpu")).startswith("cuda") else "host"
    train = train and "06" in notebooks
    needs = capture_needs(shape, profile, rates, train) if "01" in notebooks else []
    if "02" in notebooks:
        needs += stats_needs(shape, profile, rates, route, budget, where)
    if train:
        needs += train_needs(shape, profile, rates, where, n_drafts=6)
    if "07" in notebooks:
        needs += eval_needs(shape, profile, rates)
    if "08" in notebooks:
        extra_k = Path(shape.name).stem in str(profile.get("extra_k_models", "")).split(",")
        needs += [need for need in study_needs(shape, profile, rates, where, extra_k)
                  if need.step[:2] in notebooks]
    if "12" in notebooks:
        needs += longrun_needs(shape, profile, rates)
    return needs


def refusals(needs: list[Need], limits: Limits) -> list[str]:
    """One line per limit exceeded: disk adds up over the steps, memory is per step."""
    lines, disk = [], 0.0
    for need in needs:
        if need.limit == "disk":
            disk += need.bytes_needed
            if disk > limits.disk:
                lines.append(f"{need.step}: with the steps before it needs {_gib(disk)} of "
                             f"disk, {_gib(limits.disk)} free; change {need.setting}")
        elif need.limit and need.bytes_needed > getattr(limits, need.limit):
            lines.append(f"{need.step}: needs {_gib(need.bytes_needed)} of {need.limit} "
                         f"memory, {_gib(getattr(limits, need.limit))} available; change "
                         f"{need.setting}")
    return lines


def render(shape: Shape, profile_name: str, profile: dict, needs: list[Need],
           limits: Limits, summary: Path) -> str:
    """The plan as text: a header, one row per step, the sources of the rates."""
    header = (f"actwave plan · {Path(shape.name).stem} (N={shape.layers}, d={shape.dim}, "
              f"V={shape.vocab:,}, {shape.params / 1e9:.2f}B parameters) · profile "
              f"{profile_name} · device {profile.get('device', 'cpu')}\n"
              f"limits: host memory {_gib(limits.host)}, device memory {_gib(limits.device)}, "
              f"disk {_gib(limits.disk)}\n")
    rows = [f"  {'step':<34} {'needs':>10}  {'time':>8}  detail"]
    for need in needs:
        size = _gib(need.bytes_needed) if need.bytes_needed else "-"
        when = _time(need.seconds) if need.seconds is not None else "-"
        where = f" ({need.limit})" if need.limit else ""
        rows.append(f"  {need.step:<34} {size:>10}  {when:>8}  {need.detail}{where}")
    total = sum(n.seconds for n in needs if n.seconds is not None)
    later = "; notebooks 03-05 add about a minute" if any(n.step[:2] == "02" for n in needs) else ""
    rows.append(f"  {'total time':<34} {'':>10}  {_time(total):>8}  at the rates measured on 2 "
                f"CPU cores (sources below){later}")
    return header + "\n".join(rows) + "\n" + RATE_SOURCES.format(summary=summary) + "\n"


# 1 PiB: no single machine offers more; a larger value is a typo that would make
# every step "fit".
MAX_GIB = 2.0**20


def limit_bytes(option: str, gib: float | None) -> float | None:
    """A size given on the command line in GiB -> bytes (None stays None: measure it).

    Refuses NaN, inf, zero, negatives and more than ``MAX_GIB``, naming the option.
    """
    if gib is None:
        return None
    if not (math.isfinite(gib) and 0 < gib <= MAX_GIB):
        raise ValueError(f"{option} must be a number of GiB in (0, {MAX_GIB:,.0f}], got {gib!r}")
    return gib * GIB


def _limits(args, profile: dict) -> Limits:
    cuda = str(profile.get("device", "cpu")).startswith("cuda")
    memory = limit_bytes("--memory-gib", args.memory_gib)
    device_memory = limit_bytes("--device-memory-gib", args.device_memory_gib)
    disk = limit_bytes("--disk-gib", args.disk_gib)
    host = memory if memory is not None else available_bytes("cpu") or 0
    if device_memory is not None:
        device = device_memory
    elif cuda and torch.cuda.is_available():
        device = available_bytes("cuda")
    else:
        device = 80 * GIB if cuda else host  # the gpu profile is sized for an 80 GB GPU
    if disk is None:
        disk = shutil.disk_usage(cache_dir() if cache_dir().exists() else cache_dir().parent).free
    return Limits(host=float(host), device=float(device), disk=float(disk))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actwave plan",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="bundled name, folder, HF id or config JSON (default: "
                                         "each of the profile's models)")
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--memory-gib", type=float, help="host memory (default: MemAvailable)")
    parser.add_argument("--device-memory-gib", type=float,
                        help="accelerator memory (default: free CUDA memory, else 80 GiB)")
    parser.add_argument("--disk-gib", type=float, help="free disk (default: the cache's disk)")
    parser.add_argument("--stats-route", default="all_pairs", choices=("all_pairs", "block_pairs"))
    parser.add_argument("--stats-budget-gib", type=float,
                        help="block_pairs memory budget (default: the memory it runs in)")
    parser.add_argument("--rates", default="results/benchmarks/summary.csv",
                        help="a benchmarks/run_all.py summary.csv (relative: to the repo root)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        # flat parameters (actwave.profile); keys the profile does not set: the cpu profile's
        profile = {**parameters(load_profile("cpu")), **parameters(load_profile(args.profile))}
        summary = Path(args.rates) if Path(args.rates).is_absolute() else repo_root() / args.rates
        rates, limits = read_rates(summary), _limits(args, profile)
        where = "device" if str(profile.get("device", "cpu")).startswith("cuda") else "host"
        budget = limit_bytes("--stats-budget-gib", args.stats_budget_gib)
        budget = budget if budget is not None else getattr(limits, where)
        trained = str(profile.get("train_models", profile["models"])).split(",")
        models = [args.model] if args.model else str(profile["models"]).split(",")
        plans = [(shape, plan_needs(shape, profile, rates, args.stats_route, budget,
                                    train=bool(args.model) or shape.name in trained))
                 for shape in map(model_shape, models)]
    except (Refusal, ValueError, OSError) as err:
        print(f"actwave plan: {err}", file=sys.stderr)
        return 2
    refused = []
    for shape, needs in plans:
        print(render(shape, args.profile, profile, needs, limits, Path(args.rates)), end="")
        refused += refusals(needs, limits)
    for line in refused:
        print(f"REFUSED {line}", file=sys.stderr)
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
