"""How the notebooks hand over: what notebook 01 captures, and where later notebooks find it.

Three JSON indexes in ``config.results_dir(profile)`` connect the stages; each names
folders relative to ``config.cache_dir()``, so later notebooks open artifacts without
re-declaring the parameters that keyed them:

    01_stores.json         {model: {split: {"store": "capture/<folder>", "config": {...}}}}
    05_candidate_sets.json {model: {label: [layer ids]}}
    06_drafts.json         {model: {label: "drafts/<folder>/draft"}}

A missing index, or one without the requested model, is an error naming the notebook that
writes it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from actwave import profile
from actwave.capture.models import model_digest, slug
from actwave.capture.store import CaptureConfig, CaptureStore, store_dir
from actwave.config import artifact_dir, cache_dir, to_jsonable

STORES = "01_stores"
CANDIDATE_SETS = "05_candidate_sets"
DRAFTS = "06_drafts"
WRITERS = {STORES: "01_capture", CANDIDATE_SETS: "05_layer_selection",
           DRAFTS: "06_train_drafts"}


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


def stores_index(configs: dict[tuple[str, str], CaptureConfig]) -> dict[str, dict]:
    """The ``01_stores`` index of captured configs: {model: {split: {"store", "config"}}}."""
    index: dict[str, dict] = {}
    for (name, split), config in configs.items():
        index.setdefault(name, {})[split] = {"store": cache_relative(store_dir(config)),
                                             "config": to_jsonable(config)}
    return index


def read_index(results_dir: Path | str, name: str, models: list[str]) -> dict[str, Any]:
    """{model: entry} of index ``name`` (see module docstring) for each of ``models``."""
    if name not in WRITERS:
        raise ValueError(f"unknown index {name!r}; known: {sorted(WRITERS)}")
    path = Path(results_dir) / f"{name}.json"
    writer = WRITERS[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run notebook {writer} first "
                                f"(same profile: {Path(results_dir).name})")
    index = json.loads(path.read_text())
    missing = [model for model in models if model not in index]
    if missing:
        raise ValueError(f"{path} has nothing for {missing} (it has {sorted(index)}): run "
                         f"notebook {writer} with these models")
    return {model: index[model] for model in models}


def open_stores(results_dir: Path | str, models: list[str],
                split: str) -> dict[str, CaptureStore]:
    """{model: the finished ``split`` store notebook 01 indexed}, in ``models`` order."""
    entries = read_index(results_dir, STORES, models)
    missing = [model for model, splits in entries.items() if split not in splits]
    if missing:
        raise ValueError(f"notebook 01 made no {split!r} store for {missing}: run 01_capture "
                         f"with them in {'train_models' if split == 'train' else 'models'}")
    return {model: CaptureStore(cache_dir() / splits[split]["store"])
            for model, splits in entries.items()}


def draft_key(model: str, config: Any, train_store: CaptureStore,
              eval_store: CaptureStore) -> dict:
    """What names a draft: its ``TrainConfig``, the content digest of the target's files
    (``models.model_digest``) and the content digests of both stores (``CaptureStore.digest``),
    so a new target or a recaptured store never reuses an old draft."""
    return {"train": config, "model": model, "target": model_digest(model),
            "store": train_store.digest, "eval_store": eval_store.digest}


def draft_dir(model: str, config: Any, train_store: CaptureStore,
              eval_store: CaptureStore) -> Path:
    """Cache folder of one draft, keyed by ``draft_key``."""
    key = draft_key(model, config, train_store, eval_store)
    layers = "-".join(str(layer) for layer in config.layer_ids)
    return artifact_dir("drafts", key, name=f"{slug(model)}-L{layers}")
