"""Long runs of the layer-set study: every set scored at matched, decayed budgets (issue 21).

The first study (``actwave.study.runs``) trains each draft 64 steps × batch 2 (one epoch of
~24k tokens, τ̂ ≈ 1.18), where the learning-rate schedule alone moves τ̂ more than any
layer-set difference. Here each (set, seed) gets one warmup-stable-decay *trunk* and, per
budget b ∈ {1, 4, 16, 32} × 64 steps, a *branch* that decays the LR to 0 at step b
(``actwave.eagle3.schedule``); each branch is scored and written as one small JSON record,

    results/study/long/<model>/records/<label>-s<seed>-b<steps>.json

holding the config (set, seed, budget, schedule, the regenerated pools' digests), the
training seconds and tokens up to b (with the host, device, threads and load average, to
judge whether the machine was idle), offline τ̂ (chain depth K = ttt_steps) on the held-out
pool, per-TTT-step acceptance and agreement, and the **per-position accepted-chain length**
of every held-out root (``longscore.encode_positions``): the array ``decode_walk`` walks, so a
decoding τ on the same greedy text can be checked exactly against it.

Training reads the target's features computed once per text (``eagle3.features``: the
states of every layer the planned sets use, and the target's argmax), instead of running
the target inside every step as online training does (``eagle3.online``; on 2 CPU cores
the target's forward was 1.5 s of a 1.95 s step). Training features are stored in
``feature_dtype`` (bf16, as EAGLE-3 stores hidden states), held-out ones in float32 and
batched as online scoring batches them, so scoring equals online scoring. The trunk and
branches resume from checkpoints at step granularity, and a finished record is never
redone. Jobs run in ``plan`` order: the 1× and 4× budgets whole across all sets and seeds,
then one (seed, set) trunk at a time through 16× and 32× (seed 0 of every set first).
``status`` says what is done and estimates what is left. The sets: ``actwave.study.keysets``;
the text: ``actwave.study.longtext``. Statistics over the records:
``actwave.study.stats`` (``rank_stability``, ``budget_curves``, ``budget_comparisons``).

Launch (resumable: rerun the same command after an interruption):

    actwave longrun --model smollm2-135m            # everything, in order (profile "study")
    actwave longrun --model smollm2-135m --status   # done / missing / ETA

The same command may run in several processes at once (workers): each claims a job's (set,
seed) trunk before training it and skips the jobs another live worker holds (``claim``). On
a small CPU two one-thread workers (``OMP_NUM_THREADS=1``) do more than one two-thread
worker: on 2 cores ~1.2× the work (measured with a long-run worker beside a text
regeneration, each at one thread, against each alone at two), as a batch-2 draft step does
not keep two threads busy. After a job of the profile's decoding seed at the largest budget,
the worker decodes that draft (``actwave.study.longdecode``) before a move of machine can
lose it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from actwave.config import (atomic_write_json, config_hash, cpu_name, machine,
                            package_versions)
from actwave.eagle3.features import (FeatureConfig, TargetFeatures, features_root, open_features,
                                     train_from_features)
from actwave.eagle3.online import OnlineSource
from actwave.eagle3.schedule import WSDSchedule, cost
from actwave.eagle3.train import DTYPES as TRAIN_DTYPES
from actwave.eagle3.train import Segment, TrainConfig
from actwave.integrity import Between, LockedError, WriterLock, check_fields, is_held
from actwave.study.keysets import (SETS_FILE, key_sets, one_x_tau, pin_sets, pinned_sets,
                                   read_sets)
from actwave.study.longscore import score
from actwave.study.longtext import text_sources
from actwave.study.runs import StudySet
from actwave.study.stats import PRIMARY, REFERENCE

log = logging.getLogger(__name__)
RECORD_FORMAT = "actwave-longrun-record-v2"


@dataclass(frozen=True)
class LongRunConfig:
    """The budgets, their schedule and the training / scoring settings of every draft."""

    model: str
    base_steps: int = 64
    multipliers: tuple[int, ...] = (1, 4, 16, 32)
    decay_fraction: float = 0.2
    min_decay: int = 16
    warmup_steps: int = 6
    batch_size: int = 2
    max_seq_len: int = 320
    ttt_steps: int = 3
    lr: float = 1e-3
    draft_vocab_size: int = 16384
    train_dtype: str = "float32"
    feature_dtype: str = "bfloat16"    # stored training inputs (held-out ones: float32)
    checkpoint_every: int = 64
    eval_batch_size: int = 8

    def __post_init__(self) -> None:
        check_fields(self, {name: Between(1) for name in (
            "base_steps", "multipliers", "min_decay", "batch_size", "max_seq_len", "ttt_steps",
            "draft_vocab_size", "checkpoint_every", "eval_batch_size")} | {
            "warmup_steps": Between(0), "lr": Between(0.0, low_open=True),
            "decay_fraction": Between(0.0, 1.0, low_open=True)},
            {"train_dtype": TRAIN_DTYPES, "feature_dtype": ("bfloat16", "float32")})

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(m * self.base_steps for m in self.multipliers)

    def schedule(self) -> WSDSchedule:
        return WSDSchedule(self.warmup_steps, self.budgets, self.decay_fraction, self.min_decay)

    def train_config(self, layer_ids, seed: int, total_steps: int) -> TrainConfig:
        return TrainConfig(layer_ids=tuple(layer_ids), ttt_steps=self.ttt_steps, lr=self.lr,
                           warmup_steps=self.warmup_steps, total_steps=total_steps,
                           batch_size=self.batch_size, max_seq_len=self.max_seq_len,
                           draft_vocab_size=self.draft_vocab_size, seed=seed,
                           checkpoint_every=self.checkpoint_every, dtype=self.train_dtype,
                           eval_sequences=1)


@dataclass(frozen=True)
class Job:
    """One scored draft: a set's branch at ``budget`` steps of seed ``seed``."""

    label: str
    layer_ids: tuple[int, ...]
    seed: int
    budget: int

    @property
    def name(self) -> str:
        return f"{self.label}-s{self.seed}-b{self.budget}"


# ----------------------------------------------------------------------------- planning
def plan(sets: list[StudySet], budgets, whole_budgets: int = 2) -> list[Job]:
    """Every (set, seed, budget) in run order. The first ``whole_budgets`` budgets (cheap) run
    whole: budget, then seed, then set (the reference and the primary set first), so a
    partial run compares every set there. Above them, one (seed, set) trunk runs through every
    larger budget before the next starts (seed 0 of every set first): its checkpoints live in
    the machine's cache while records are committed, so a move to a fresh machine loses at
    most one trunk's progress rather than every set's."""
    first = {REFERENCE: 0, PRIMARY: 1}
    ordered = sorted(sets, key=lambda s: first.get(s.label, 2))
    seeds = range(max(s.seeds for s in sets))
    small, large = budgets[:whole_budgets], budgets[whole_budgets:]
    return ([Job(s.label, tuple(s.layer_ids), seed, budget) for budget in small
             for seed in seeds for s in ordered if seed < s.seeds]
            + [Job(s.label, tuple(s.layer_ids), seed, budget) for seed in seeds
               for s in ordered if seed < s.seeds for budget in large])


def job_steps(jobs: list[Job], schedule: WSDSchedule) -> dict[Job, int]:
    """Optimizer steps each job trains: the trunk from the previous budget's branch point
    (of the same set and seed) to this one's, plus the branch's d_b."""
    reached: dict[tuple, int] = {}
    steps = {}
    for job in sorted(jobs, key=lambda j: j.budget):
        trunk = (job.label, job.seed)
        start = schedule.branch_start(job.budget)
        steps[job] = start - reached.get(trunk, 0) + schedule.decay_steps(job.budget)
        reached[trunk] = start
    return steps


def record_path(results_dir: Path, job: Job) -> Path:
    return Path(results_dir) / "records" / f"{job.name}.json"


def status(jobs: list[Job], results_dir: Path, schedule: WSDSchedule,
           fallback_seconds_per_step: float = 1.1, fallback_score_seconds: float = 200.0
           ) -> dict:
    """What is done and what is left, from the records on disk.

    -> {"done", "missing" (job names in run order), "by_budget" {budget: [done, total]},
    "seconds_per_step" (median over the records made on this CPU model, else over all),
    "score_seconds" (mean per record, the same records), "remaining_seconds" (missing jobs'
    steps × s/step + scoring)}. Before any record the fallbacks: 1.1 s/step (the online
    benchmark draft, batch 2 × 320 tokens, 2 idle cores) and ~200 s to score 400 held-out
    sequences (extrapolated from 2.5 s/sequence on one thread of a loaded machine).
    """
    records = {j: json.loads(record_path(results_dir, j).read_text()) for j in jobs
               if record_path(results_dir, j).exists()}
    timed = ([r for r in records.values() if r.get("machine", {}).get("cpu") == cpu_name()]
             or list(records.values()))  # another CPU's seconds are a poorer guess
    per_step = [r["training"]["seconds"] / r["budget"] for r in timed]
    seconds_per_step = float(np.median(per_step)) if per_step else fallback_seconds_per_step
    score_seconds = float(np.mean([r["training"]["score_seconds"] for r in timed])
                          if timed else fallback_score_seconds)
    steps = job_steps(jobs, schedule)
    missing = [j for j in jobs if j not in records]
    by_budget = {b: [sum(j.budget == b for j in records), sum(j.budget == b for j in jobs)]
                 for b in schedule.budgets}
    return {"done": [j.name for j in jobs if j in records], "missing": [j.name for j in missing],
            "by_budget": by_budget, "seconds_per_step": seconds_per_step,
            "score_seconds": score_seconds,
            "remaining_seconds": sum(steps[j] * seconds_per_step + score_seconds
                                     for j in missing)}


# ----------------------------------------------------------------------------- running
@dataclass
class LongRun:
    """Everything the jobs of one model share: config, target, features and folders."""

    config: LongRunConfig
    target: object
    train: TargetFeatures      # of the train pool (max_seq_len-truncated text)
    eval: TargetFeatures       # of the held-out pool, scored whole
    results_dir: Path          # records/ goes here
    work_dir: Path             # features/, trunks/ and branches/ (checkpoints, drafts): the cache


def features(config: LongRunConfig, target, train: OnlineSource, eval_: OnlineSource,
             layers, root: Path, progress: bool = True) -> tuple[TargetFeatures, TargetFeatures]:
    """The target's features of the train and held-out text for ``layers`` under ``root``
    (computed, resumed, or found in a folder holding more layers): training inputs in
    ``config.feature_dtype``, held-out ones in float32, both batched as online scoring
    (``eval_batch_size``) so scores equal it. The benchmark draft reads the same folders."""
    train_config, eval_config = feature_configs(config, layers)
    return (open_features(train, target, train_config, root, progress),
            open_features(eval_, target, eval_config, root, progress))


def feature_configs(config: LongRunConfig, layers) -> tuple[FeatureConfig, FeatureConfig]:
    """The features' configs of the train text and of the held-out text."""
    return (FeatureConfig(tuple(layers), config.feature_dtype, config.eval_batch_size),
            FeatureConfig(tuple(layers), "float32", config.eval_batch_size))


def open_run(config: LongRunConfig, target, train: OnlineSource, eval_: OnlineSource,
             sets: list[StudySet], results_dir: Path, work_dir: Path,
             features_root: Path | None = None, progress: bool = True) -> LongRun:
    """The ``LongRun`` of ``sets``, with the target's features of both texts for every layer
    the sets use (``features``; under ``features_root``, default ``work_dir/features``)."""
    layers = sorted({i for s in sets for i in s.layer_ids})
    root = Path(features_root or Path(work_dir) / "features")
    train_features, eval_features = features(config, target, train, eval_, layers, root,
                                             progress)
    return LongRun(config, target, train_features, eval_features, Path(results_dir),
                   Path(work_dir))


def trunk_key(run: LongRun, job: Job) -> str:
    """What a (set, seed)'s trunk, and so each of its records, depends on (the features'
    values, not which other layers they also hold)."""
    return job_key(run.config, job, run.train.digest, run.eval.digest)


def job_key(config: LongRunConfig, job: Job, train_digest: str, eval_digest: str) -> str:
    """``trunk_key`` from the features' values digests (``features.values_digest``), which
    are known before the features are computed."""
    return config_hash({"config": asdict(config), "layer_ids": job.layer_ids,
                        "seed": job.seed, "train": train_digest, "eval": eval_digest})


def _trunk_dir(run: LongRun, job: Job) -> Path:
    return Path(run.work_dir) / "trunks" / f"{job.label}-s{job.seed}-{trunk_key(run, job)}"


def _branch_dir(run: LongRun, job: Job) -> Path:
    return Path(run.work_dir) / "branches" / f"{job.name}-{trunk_key(run, job)}"


def load_record(path: Path, key: str | None = None) -> dict | None:
    """A finished record (None if absent or made under another key)."""
    if not Path(path).exists():
        return None
    record = json.loads(Path(path).read_text())
    if record.get("format") != RECORD_FORMAT:
        raise ValueError(f"{path} is not a long-run record (format {record.get('format')!r})")
    return record if key is None or record.get("key") == key else None


def branch_point(run: LongRun, job: Job, progress: bool = False) -> Path:
    """The trunk's checkpoint at the branch's first step b − d_b, kept as its own copy (the
    trunk goes on and drops older checkpoints); trains the trunk there first if needed."""
    schedule = run.config.schedule()
    start = schedule.branch_start(job.budget)
    trunk = _trunk_dir(run, job)
    point = trunk / "branch-points" / f"step-{start:07d}"
    if point.is_dir():
        return point
    config = run.config.train_config(job.layer_ids, job.seed, max(schedule.budgets))
    train_from_features(run.train, run.target, config, trunk, progress,
                        segment=Segment(schedule.trunk(), stop_at=start))
    tmp = point.with_name(f".tmp-{point.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(trunk / "checkpoints" / point.name, tmp)
    os.replace(tmp, point)
    return point


def _branch_started(branch: Path) -> bool:
    """Whether the branch has a checkpoint or a finished draft of its own."""
    return (branch / "config.json").exists() or any((branch / "checkpoints").glob("step-*"))


def run_job(job: Job, run: LongRun, progress: bool = False) -> dict:
    """Train (or resume, or skip) one job's trunk segment and branch, score the branch and
    write its record; -> the record. The branch point and the branch's checkpoints are
    removed once the record is written (the branch's draft stays in the cache)."""
    key = trunk_key(run, job)
    path = record_path(run.results_dir, job)
    existing = load_record(path, key)
    if existing is not None:
        return existing
    where = machine(str(next(run.target.parameters()).device))
    schedule = run.config.schedule()
    branch = _branch_dir(run, job)
    point = None if _branch_started(branch) else branch_point(run, job, progress)
    config = run.config.train_config(job.layer_ids, job.seed, job.budget)
    result = train_from_features(run.train, run.target, config, branch, progress,
                                 segment=Segment(schedule.branch(job.budget), init_from=point))
    tic = time.perf_counter()
    offline = score(result.draft, run.eval.train_data(job.layer_ids), run.config.ttt_steps)
    start = schedule.branch_start(job.budget)
    seconds = result.history[-1]["seconds"]
    record = {"format": RECORD_FORMAT, "key": key, "model": run.config.model,
              "label": job.label, "layer_ids": list(job.layer_ids), "seed": job.seed,
              "budget": job.budget, "longrun": asdict(run.config), "train": asdict(config),
              "schedule": {"kind": "wsd", "warmup_steps": schedule.warmup_steps,
                           "branch_start": start, "decay_steps": schedule.decay_steps(job.budget),
                           "trunk_steps": schedule.trunk_steps},
              "data": {"train": run.train.source.digest, "train_path": run.train.source.path,
                       "eval": run.eval.source.digest, "eval_path": run.eval.source.path,
                       "train_features": run.train.digest, "eval_features": run.eval.digest},
              "training": {"steps": len(result.history), "seconds": seconds,
                           "trunk_seconds": result.history[start - 1]["seconds"],
                           "tokens": int(sum(row["tokens"] for row in result.history)),
                           "score_seconds": time.perf_counter() - tic},
              "machine": {**where, "load_average_end": os.getloadavg()[0]},
              "draft_fingerprint": result.draft.fingerprint(),
              "offline": offline, "versions": package_versions()}
    atomic_write_json(path, record)
    shutil.rmtree(branch / "checkpoints", ignore_errors=True)
    shutil.rmtree(_trunk_dir(run, job) / "branch-points" / f"step-{start:07d}", ignore_errors=True)
    return load_record(path)


def run_jobs(jobs: list[Job], run: LongRun, max_jobs: int | None = None,
             progress: bool = True, deadline: float | None = None,
             after: Callable[[dict], object] | None = None) -> list[dict]:
    """``run_job`` over ``jobs`` in order (the first ``max_jobs`` missing ones; none started
    once ``time.monotonic()`` passes ``deadline``, so a lent machine's time is spent on whole
    records; the job under way when it passes is finished). ``after(record)`` runs after each
    job this worker trained (``actwave longrun`` decodes a finished draft there)."""
    records, trained = [], 0
    for job in jobs:
        if max_jobs is not None and trained >= max_jobs:
            break
        done = load_record(record_path(run.results_dir, job), trunk_key(run, job)) is not None
        if not done and deadline is not None and time.monotonic() > deadline:
            log.info("deadline passed: %s and later jobs not started", job.name)
            break
        with contextlib.ExitStack() as claimed:
            if not done:
                try:
                    claimed.enter_context(claim(run, job))
                except LockedError as held:
                    log.info("%s: skipped, another worker has it (%s)", job.name, held)
                    continue
            trained += not done
            records.append(run_job(job, run, progress))
            if after is not None and not done:
                after(records[-1])
        log.info("%s: tau_hat %.4f", job.name, records[-1]["offline"]["tau_hat"])
    return records


def claim(run: LongRun, job: Job) -> WriterLock:
    """A job's claim, taken without waiting: the lock of its (set, seed) trunk's claim folder.
    Workers sharing one job list (``actwave longrun`` started twice) each skip the jobs whose
    trunk another live worker is training, so no trunk or branch is trained twice at once;
    the kernel drops a claim when its worker dies, so a rerun picks the job up."""
    return WriterLock(Path(run.work_dir) / "claims" / f"{job.label}-s{job.seed}-"
                      f"{trunk_key(run, job)}", timeout=0)


def live_workers(work_dir: Path) -> int:
    """How many jobs live workers hold now (``claim``s whose lock a process holds)."""
    claims = Path(work_dir) / "claims"
    return sum(is_held(folder) for folder in claims.iterdir()) if claims.is_dir() else 0


def results_folder(model: str, study_results: Path | None = None) -> Path:
    """``<study results>/long/<model slug>``: the long runs' records/ folder lives here."""
    from actwave.capture.models import slug
    from actwave.config import results_dir

    return Path(study_results or results_dir("study")) / "long" / slug(model)


def work_folder(model: str) -> Path:
    """``cache_dir()/longrun/<model slug>``: trunks, branches and their drafts."""
    from actwave.capture.models import slug
    from actwave.config import cache_dir

    return cache_dir() / "longrun" / slug(model)


def load_records(folder: Path) -> list[dict]:
    """Every record under ``folder/records``, sorted by file name."""
    return [load_record(path) for path in sorted((Path(folder) / "records").glob("*.json"))]


def study_sets(model: str, labels=None, seeds: int = 3,
               study_results: Path | None = None) -> list[StudySet]:
    """The sets to run: the pre-registered key sets with ``seeds`` seeds, or the 1× study's
    sets named in ``labels`` ("all": every set), from the 1× study's set table and records in
    ``study_results`` (default ``results/study``).

    The key sets are chosen once (``key_sets`` on the 1× study as it stands) and pinned in
    ``<long-run results>/sets.json``: a later rerun of the 1× study (new splits, new
    statistics) must not move a pre-registration whose records are committed."""
    from actwave.capture.models import slug
    from actwave.config import results_dir
    from actwave.study.runs import load_records as load_one_x

    folder = Path(study_results or results_dir("study"))
    table = folder / f"08_sets_{slug(model)}.csv"
    if labels == "all":
        return read_sets(table, None, seeds)
    if labels:
        return read_sets(table, labels, seeds)
    pinned = results_folder(model, folder) / SETS_FILE
    if pinned.is_file():
        return pinned_sets(pinned, seeds)
    one_x = one_x_tau(load_one_x(folder / slug(model)))
    sets = key_sets(read_sets(table), one_x, seeds)
    pin_sets(pinned, sets, one_x, f"key_sets on {table.name} and the 1× records")
    return sets


def prepare(model: str, config: LongRunConfig, sets: list[StudySet], n_train: int = 3200,
            n_eval: int = 400, results: Path | None = None, progress: bool = True) -> LongRun:
    """Load the target and the text of one model's long runs (``load_text``) and compute (or
    find) the target's features for ``sets`` (``open_run``)."""
    target, sources = load_text(model, config, n_train, n_eval)
    return open_run(config, target, sources["train"], sources["eval"], sets,
                    Path(results or results_folder(model)), work_folder(model),
                    features_root(model), progress)


def load_text(model: str, config: LongRunConfig, n_train: int, n_eval: int
              ) -> tuple[object, dict[str, OnlineSource]]:
    """The target (float32: its argmax labels every draft) and the long runs' text of
    ``model`` (``text_sources``: its pools, else ShareGPT). -> (target, {"train", "eval"})."""
    from accelerate import Accelerator

    from actwave.capture.models import load

    target, tokenizer = load(model, dtype=torch.float32, device=Accelerator().device)
    return target, text_sources(model, tokenizer, config.max_seq_len, n_train, n_eval)


# the profile's top-level keys of the long runs, beside its ``longrun`` section
PROFILE_KEYS = ("longrun_sets", "longrun_seeds", "longrun_train_conversations",
                "longrun_eval_conversations", "longrun_decode_seed", "longrun_decode_prompts",
                "longrun_decode_new_tokens", "longrun_decode_max_prompt_tokens", "routes",
                "acceptance_prompts")


def main(argv: list[str] | None = None) -> None:
    """Command line: status, or run the long study of one model, with the settings of a
    profile (``profiles/study.yaml``: the ``longrun`` section and the ``longrun_*`` keys, the
    same values notebook 12 reads), so the command and the notebook write the same records."""
    import argparse

    from actwave.profile import build, parameters
    from actwave.tools.runplan import load_profile

    parser = argparse.ArgumentParser(description="Layer sets at matched, decayed budgets.")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", default="study", help="the profile whose settings run")
    parser.add_argument("--labels", default=None, help="comma-separated set labels of the 1× "
                        "study, or 'all' (default: the profile's longrun_sets)")
    parser.add_argument("--max-jobs", type=int, default=None, help="stop after this many jobs")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no job after this many minutes (a lent GPU's time)")
    parser.add_argument("--status", action="store_true", help="print done / missing / ETA; exit")
    args = parser.parse_args(argv)
    values = parameters(load_profile(args.profile))
    missing = [key for key in PROFILE_KEYS if key not in values]
    if missing:
        parser.error(f"profile {args.profile!r} lacks {missing}: the long runs read them "
                     "(profiles/study.yaml has them)")
    config = build("longrun", values, model=args.model)
    labels = values["longrun_sets"] if args.labels is None else args.labels
    if labels not in ("", "all"):
        labels = labels.split(",")
    sets = study_sets(args.model, labels or None, values["longrun_seeds"])
    jobs = plan(sets, config.budgets)
    results = results_folder(args.model)
    steps = cost(config.schedule())
    print(f"budgets {config.budgets}: {steps['wsd']} steps per (set, seed) with decay branches "
          f"(trunk {steps['trunk']} + decays {steps['branches']}) vs {steps['separate']} for "
          f"separate cosine runs; {len(jobs)} jobs, sets {[s.label for s in sets]}")
    report = status(jobs, results, config.schedule())
    hours, workers = report["remaining_seconds"] / 3600, live_workers(work_folder(args.model))
    # The rate is per worker (each record times its own job), so n workers share the hours.
    shared = f", ~{hours / workers:.1f} h with the {workers} live workers" if workers > 1 else ""
    print(f"done {len(report['done'])}/{len(jobs)} {report['by_budget']}; about {hours:.1f} h "
          f"of one worker left at {report['seconds_per_step']:.2f} s/step{shared}; next "
          f"{report['missing'][:1]}")
    if args.status:
        return
    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    run = prepare(args.model, config, sets, values["longrun_train_conversations"],
                  values["longrun_eval_conversations"], results=results)
    run_jobs(jobs, run, args.max_jobs, deadline=deadline,
             after=lambda record: decode_finished(args.model, record, values, config, results))


def decode_finished(model: str, record: dict, values, config: LongRunConfig,
                    results: Path) -> None:
    """After a job: decode its draft when it is the profile's decoding seed at the largest
    budget (``longdecode``: on the machine that trained it, before the draft can be lost)."""
    from actwave.study import longdecode

    budget, seed = max(config.budgets), values["longrun_decode_seed"]
    if (record["budget"], record["seed"]) != (budget, seed):
        return
    work = work_folder(model)
    try:
        longdecode.decode_due(model, [record], budget, seed, values, config.ttt_steps, results,
                              work)
    except Exception:  # the worker's job is training: a failed check must not stop the runs
        log.exception("decoding %s seed %s failed; notebook 12 retries it while the draft is "
                      "on this machine", record["label"], seed)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
