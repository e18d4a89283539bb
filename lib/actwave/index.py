"""The one registry of the notebooks: which stores, layer sets and drafts exist, and where.

Four JSON indexes in ``config.results_dir(profile)`` connect the stages; each names
folders relative to ``config.cache_dir()``, so later notebooks open artifacts without
re-declaring the parameters that keyed them:

    01_stores.json         {model: {split: {"store": "capture/<folder>", "config": {...}}}}
    05_candidate_sets.json {model: {label: [layer ids]}}
    06_drafts.json         {model: {label: "drafts/<folder>/draft"}}
    08_stores.json         the study's train / eval stores, laid out as 01_stores.json

A missing index, or one without the requested model, is an error naming the notebook that
writes it. Every draft, whoever trains it (notebooks 06 and 08/09, ``--validate``, the
benchmark draft), is cached in the folder ``draft_dir`` names:
``cache_dir()/drafts/<model slug>-L<layers>-s<seed>-<key>``. The long runs' trunk and
branch checkpoints (``cache_dir()/longrun/``) are their work area, not this draft cache.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actwave import profile
from actwave.capture.models import model_digest, slug
from actwave.capture.store import CaptureConfig, CaptureStore, store_dir
from actwave.config import cache_dir, config_hash, to_jsonable

STORES = "01_stores"
CANDIDATE_SETS = "05_candidate_sets"
DRAFTS = "06_drafts"
STUDY_STORES = "08_stores"
WRITERS = {STORES: "01_capture", CANDIDATE_SETS: "05_layer_selection",
           DRAFTS: "06_train_drafts", STUDY_STORES: "08_study_drafts"}
STORE_INDEXES = (STORES, STUDY_STORES)


def names(text: str) -> list[str]:
    """A comma-separated parameter ("a, b,") as a list of its non-empty items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def capture_configs(models: str, train_models: str,
                    values: Mapping[str, Any]) -> dict[tuple[str, str], CaptureConfig]:
    """{(model, split): CaptureConfig} notebook 01 captures, every analysis split first.

    Every model gets an ``analysis`` split (the ``capture`` section of ``values``, original
    ShareGPT replies); the models of ``train_models`` also get a ``train`` split (the
    ``train_capture`` section). ``values``: flat profile parameters (``actwave.profile``).
    """
    model_names, trained = names(models), names(train_models)
    unknown = [name for name in trained if name not in model_names]
    if unknown:
        raise ValueError(f"train_models {unknown} are not in models {model_names}")
    configs = {(name, "analysis"): profile.build("capture", values, model=name, split="analysis")
               for name in model_names}
    configs.update({(name, "train"): profile.build("train_capture", values, model=name,
                                                   split="train") for name in trained})
    return configs


def cache_relative(path: Path | str) -> str:
    """A folder under ``cache_dir()`` as the relative path the indexes record."""
    return Path(path).resolve().relative_to(cache_dir().resolve()).as_posix()


def stores_index(configs: dict[tuple[str, str], CaptureConfig],
                 known: Mapping[str, dict] | None = None) -> dict[str, dict]:
    """A store index (``01_stores`` or ``08_stores``): {model: {split: {"store", "config"}}}.

    ``configs``: {(model, split): CaptureConfig} of the stores a run captured; ``known``: the
    index as written so far (``read_whole_index``), whose other models are kept, so a run for
    some models leaves the others' stores indexed. A model of ``configs`` gets only its new
    splits.
    """
    index = {model: splits for model, splits in (known or {}).items()
             if model not in {name for name, _ in configs}}
    for (name, split), config in configs.items():
        index.setdefault(name, {})[split] = {"store": cache_relative(store_dir(config)),
                                             "config": to_jsonable(config)}
    return index


def _path(results_dir: Path | str, name: str) -> Path:
    """``results_dir/<name>.json`` of a known index ``name`` (see module docstring)."""
    if name not in WRITERS:
        raise ValueError(f"unknown index {name!r}; known: {sorted(WRITERS)}")
    return Path(results_dir) / f"{name}.json"


def read_whole_index(results_dir: Path | str, name: str) -> dict[str, Any]:
    """Index ``name`` as written so far, every model ({} before its writer's first run)."""
    path = _path(results_dir, name)
    return json.loads(path.read_text()) if path.is_file() else {}


def read_index(results_dir: Path | str, name: str, models: list[str]) -> dict[str, Any]:
    """{model: entry} of index ``name`` (see module docstring) for each of ``models``."""
    path, writer = _path(results_dir, name), WRITERS[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run notebook {writer} first "
                                f"(same profile: {Path(results_dir).name})")
    index = read_whole_index(results_dir, name)
    missing = [model for model in models if model not in index]
    if missing:
        raise ValueError(f"{path} has nothing for {missing} (it has {sorted(index)}): run "
                         f"notebook {writer} with these models")
    return {model: index[model] for model in models}


def store_path(entry: str | Mapping[str, Any]) -> Path:
    """The store folder of one (model, split) entry of a store index.

    ``entry``: {"store": folder under ``cache_dir()``, "config"}, or the bare folder, as
    notebook 08 wrote ``08_stores.json`` before it shared 01's layout: the committed
    ``results/study/08_stores.json`` is the record of the run that made the study's records,
    so it is read as written; a rerun of notebook 08 rewrites it in the shared layout.
    """
    return cache_dir() / (entry if isinstance(entry, str) else entry["store"])


def open_stores(results_dir: Path | str, models: list[str], split: str,
                name: str = STORES) -> dict[str, CaptureStore]:
    """{model: the finished ``split`` store of store index ``name``}, in ``models`` order."""
    if name not in STORE_INDEXES:
        raise ValueError(f"{name!r} is not a store index; store indexes: {STORE_INDEXES}")
    entries = read_index(results_dir, name, models)
    missing = [model for model, splits in entries.items() if split not in splits]
    if missing:
        hint = (f"run it with them in {'train_models' if split == 'train' else 'models'}"
                if name == STORES else f"it makes {sorted(entries[missing[0]])}")
        raise ValueError(f"notebook {WRITERS[name]} made no {split!r} store for {missing}: "
                         f"{hint}")
    return {model: CaptureStore(store_path(splits[split])) for model, splits in entries.items()}


def draft_key(model: str, config: Any, train_store: CaptureStore,
              eval_store: CaptureStore) -> str:
    """The key of a notebook-06 draft: the hash of its ``TrainConfig``, the content digest of
    the target's files (``models.model_digest``) and the content digests of both stores
    (``CaptureStore.digest``), so a new target or a recaptured store never reuses a draft."""
    return config_hash({"train": config, "model": model, "target": model_digest(model),
                        "store": train_store.digest, "eval_store": eval_store.digest})


def draft_dir(model: str, train: Any, key: str) -> Path:
    """The cache folder of a draft: ``cache_dir()/drafts/<slug>-L<layers>-s<seed>-<key>``.

    The one naming rule of every draft. ``train``: its ``TrainConfig`` (layers and seed, for
    a reader of the folder name); ``key``: the ``config_hash`` of everything the draft
    depends on (``draft_key`` for notebook 06, ``study.runs.record_key`` for the study and
    ``--validate``, the config and features digest for the benchmark draft), so two callers
    share a folder only for the same draft.
    """
    if not re.fullmatch(r"[0-9a-f]+", key):
        raise ValueError(f"draft key must be a config hash (hex digits), got {key!r}")
    layers = "-".join(str(layer) for layer in train.layer_ids)
    return cache_dir() / "drafts" / f"{slug(model)}-L{layers}-s{train.seed}-{key}"
