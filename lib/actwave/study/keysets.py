"""The long runs' pre-registered layer sets: read from the 1× study's set table, chosen once
by ``key_sets`` (the default, the paper's method with and without the token filter, the best
compartments pick and the best random triple by 1× τ̂, a set holding the last layer) and
pinned in ``sets.json`` beside the long-run records, so a rerun of the 1× study cannot move
a pre-registration whose records are committed (``actwave.study.longrun.study_sets``).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from actwave.config import atomic_write_json
from actwave.study.runs import StudySet
from actwave.study.stats import PRIMARY, REFERENCE


def read_sets(path: Path, labels=None, seeds: int | None = None) -> list[StudySet]:
    """The study's sets from its set table (``08_sets_<model>.csv``): all, or those in
    ``labels``; each with the table's seed count, or ``seeds`` for every set."""
    with Path(path).open() as f:
        rows = list(csv.DictReader(f))
    chosen = [r for r in rows if labels is None or r["label"] in labels]
    missing = set(labels or ()) - {r["label"] for r in chosen}
    if missing:
        raise ValueError(f"{path} has no set {sorted(missing)}")
    return [StudySet(r["label"], tuple(int(v) for v in r["layer_ids"].split(",")), r["kind"],
                     seeds or int(r["seeds"]),
                     tuple(a for a in r.get("aliases", "").split(",") if a))
            for r in chosen]


# The pre-registered sets (README, "The study's next step"): the default, the paper's
# method with and without the token filter, the best compartments pick and the best random
# triple of the 1× study (by its offline τ̂), and a set holding the last layer.
KEY_SETS = (REFERENCE, PRIMARY, "renyi2_exhaustive")
BEST_OF = {"compartments": ("cka_compartments", "cka_compartments@filtered"), "random": ("random_",)}
LAST_LAYER_SET = "last_k"
SETS_FILE = "sets.json"       # beside records/: the pinned pre-registration
SETS_FORMAT = "actwave-longrun-sets-v1"


def one_x_tau(records: list[dict]) -> dict[str, float]:
    """{label: mean offline τ̂ over seeds} of the 1× study's records (main budget only)."""
    taus: dict[str, list[float]] = {}
    for record in records:
        if record.get("steps_factor", 1) == 1:
            taus.setdefault(record["label"], []).append(record["offline"]["tau_hat"])
    return {label: float(np.mean(values)) for label, values in taus.items()}


def key_sets(sets: list[StudySet], one_x: dict[str, float], seeds: int) -> list[StudySet]:
    """The pre-registered sets, ``seeds`` seeds each: ``KEY_SETS``, the best (1× τ̂) of each
    ``BEST_OF`` family, and ``LAST_LAYER_SET``, found by label or alias (a set several
    methods picked is trained once in the 1× study); a family or set the table lacks is
    refused. Two key names for one layer set run once, under the first name."""
    by_label = {name: s for s in sets for name in (s.label, *s.aliases)}
    labels = list(KEY_SETS)
    for family, prefixes in BEST_OF.items():
        members = [s.label for s in sets if s.label.startswith(prefixes) and s.label in one_x]
        if not members:
            raise ValueError(f"no scored {family} set in the study's table (prefixes {prefixes})")
        labels.append(max(members, key=lambda label: (one_x[label], label)))
    labels.append(LAST_LAYER_SET)
    missing = [label for label in labels if label not in by_label]
    if missing:
        raise ValueError(f"the study's set table has no {missing}")
    chosen: dict[tuple[int, ...], StudySet] = {}
    for label in labels:
        found = by_label[label]
        chosen.setdefault(tuple(found.layer_ids),
                          StudySet(label, tuple(found.layer_ids), found.kind, seeds))
    return list(chosen.values())


def pin_sets(path: Path, sets: list[StudySet], one_x: dict[str, float], source: str) -> None:
    """Write the pre-registered sets of a model's long runs (label, layers, kind), with the
    1× τ̂ that chose the best of each family and where they came from."""
    atomic_write_json(Path(path), {
        "format": SETS_FORMAT, "source": source, "one_x_tau": dict(sorted(one_x.items())),
        "sets": [{"label": s.label, "layer_ids": list(s.layer_ids), "kind": s.kind} for s in sets]})


def pinned_sets(path: Path, seeds: int) -> list[StudySet]:
    """The sets ``pin_sets`` wrote, ``seeds`` seeds each."""
    pinned = json.loads(Path(path).read_text())
    if pinned.get("format") != SETS_FORMAT:
        raise ValueError(f"{path} is not a long-run set file (format {pinned.get('format')!r})")
    return [StudySet(s["label"], tuple(s["layer_ids"]), s["kind"], seeds) for s in pinned["sets"]]
