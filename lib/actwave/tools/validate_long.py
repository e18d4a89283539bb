"""``select --validate`` on the long runs' text: drafts trained and scored as the long runs of
the layer-set study train theirs (``actwave.study.longrun``).

Why: the budget ``select --validate`` reads from the study's rank-stability table (e.g. 1,024
steps on SmolLM2) is the one at which the *long runs'* ranking of layer sets predicts their
ranking at the largest budget. Those drafts trained on the model's regenerated pool (3,200
conversations: at 2,048 steps × batch 2, each seen about once) under a warmup-stable-decay
schedule and were scored on 400 held-out pool conversations. Trained that long on the
study's 128 replies instead, a draft passes over them 16 times and sets may rank by
memorisation. So here each (set, seed) is one long-run ``Job`` at the budget, with the
profile's ``longrun`` section, text and scoring.

A job whose key (``longrun.job_key``: the config, layers, seed and the features' values) is
that of a committed long-run record at the same budget is read from it, not retrained: a
candidate the study also ran costs nothing. Keys are computed before any feature is, so a
fresh clone whose candidates are all committed loads only the target and the text.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from actwave.config import cache_dir, config_hash
from actwave.eagle3.features import features_root, values_digest
from actwave.profile import build, parameters
from actwave.study import longrun
from actwave.study.longrun import Job, LongRunConfig
from actwave.study.runs import StudySet

PROFILE_KEYS = ("longrun_train_conversations", "longrun_eval_conversations")


@dataclass(frozen=True)
class LongText:
    """The long runs' settings validation trains under (saved in its output)."""

    config: LongRunConfig
    n_train: int   # the first conversations of the model's train pool
    n_eval: int    # held-out pool conversations scored


def long_text(model: str, profile: dict, profile_name: str) -> LongText:
    """The ``longrun`` section and ``longrun_*`` pool sizes of ``profile``."""
    values = parameters(profile)
    missing = [key for key in PROFILE_KEYS if key not in values]
    if "longrun" not in profile or missing:
        raise ValueError(f"profile {profile_name!r} has no long-run settings (the `longrun` "
                         f"section and {list(PROFILE_KEYS)}), which validation on the long "
                         "runs' text needs; use --validate-text study or --validate-profile "
                         "study")
    return LongText(build("longrun", values, model=model), int(values[PROFILE_KEYS[0]]),
                    int(values[PROFILE_KEYS[1]]))


def records_dir(slug: str, text: LongText) -> Path:
    """Where validation's own long-run records of ``slug`` live (the cache)."""
    return cache_dir() / "validate" / f"{slug}-longrun-{config_hash(asdict(text))}"


@dataclass
class Plan:
    """The jobs of one validation, their keys, and the records already made."""

    model: str
    text: LongText
    target: object
    sources: dict               # {"train", "eval"}: OnlineSource
    folder: Path                # validation's results folder (its records/ inside)
    jobs: list[Job]
    keys: dict[Job, str]
    found: dict[Job, dict] = field(default_factory=dict)  # committed or finished records

    @property
    def missing(self) -> list[Job]:
        return [job for job in self.jobs if job not in self.found]


def plan(model: str, text: LongText, sets: list[StudySet], n_seeds: int, budget: int,
         committed: Path) -> Plan:
    """Load the target and the text, key every (set, seed) job at ``budget`` and find the
    records already made: validation's own (``records_dir``), else a committed long-run
    record of the same key (``committed``: the study's ``results/study/long/<model>``)."""
    from actwave.capture.models import slug

    target, sources = longrun.load_text(model, text.config, text.n_train, text.n_eval)
    layers = sorted({i for s in sets for i in s.layer_ids})
    digests = [values_digest(sources[split], target, feature)
               for split, feature in zip(("train", "eval"),
                                         longrun.feature_configs(text.config, layers))]
    jobs = [Job(s.label, tuple(s.layer_ids), seed, budget) for seed in range(n_seeds)
            for s in sets]
    made = Plan(model, text, target, sources, records_dir(slug(model), text), jobs,
                {job: longrun.job_key(text.config, job, *digests) for job in jobs})
    for job in jobs:
        record = (longrun.load_record(longrun.record_path(made.folder, job), made.keys[job])
                  or committed_record(job, made.keys[job], committed))
        if record is not None:
            made.found[job] = record
    return made


def committed_record(job: Job, key: str, folder: Path) -> dict | None:
    """The committed long-run record of ``job``'s layers, seed and budget under ``key``
    (the study's label replaced by ``job``'s; its file named in ``reused_from``), or None."""
    for path in sorted((Path(folder) / "records").glob(f"*-s{job.seed}-b{job.budget}.json")):
        record = longrun.load_record(path, key)
        if record is not None and tuple(record["layer_ids"]) == job.layer_ids:
            return {**record, "label": job.label, "reused_from": path.name}
    return None


def estimate_cost(run: Plan, committed: Path) -> dict:
    """Predicted seconds of the missing jobs: budget × the median seconds per step of the
    committed long-run records of this model, plus their median scoring seconds.
    -> {"seconds" (NaN without records), "source"}."""
    records = [r for r in longrun.load_records(committed) if r.get("key")]
    n_new = len(run.missing)
    reused = f"{len(run.jobs) - n_new} of {len(run.jobs)} drafts already in records"
    if not n_new:
        return {"seconds": 0.0, "source": reused}
    if not records:
        return {"seconds": math.nan, "source": f"{reused}; no long-run records of {run.model} "
                                               "to time the rest: see the drafts bar's ETA"}
    per_step = statistics.median(r["training"]["seconds"] / r["budget"] for r in records)
    scoring = statistics.median(r["training"]["score_seconds"] for r in records)
    budget = run.jobs[0].budget
    return {"seconds": n_new * (budget * per_step + scoring),
            "source": f"{reused}; {per_step:.2f} s/step + {scoring:.0f} s scoring per draft, "
                      f"medians of {len(records)} long-run drafts of {run.model}, plus the "
                      "target's features of the text when not cached"}


def train(run: Plan, sets: list[StudySet], progress: bool = True) -> dict[str, list[dict]]:
    """Every missing job trained and scored as the long runs do (``longrun.run_job``; its
    record in ``run.folder``), the found ones read. -> {label: [record per seed]}."""
    records = dict(run.found)
    if run.missing:
        work = longrun.open_run(run.text.config, run.target, run.sources["train"],
                                run.sources["eval"], sets, run.folder,
                                longrun.work_folder(run.model), features_root(run.model),
                                progress)
        for job in tqdm(run.missing, desc="validation drafts", unit="draft",
                        disable=not progress):
            records[job] = longrun.run_job(job, work, progress)
    by_label: dict[str, list[dict]] = {s.label: [] for s in sets}
    for job in run.jobs:
        by_label[job.label].append(records[job])
    return by_label
