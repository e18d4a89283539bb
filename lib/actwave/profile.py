"""Profiles: one YAML file per run size, one section per stage, keys named as the stage's fields.

``profiles/<name>.yaml`` holds a few top-level keys (``models``, ``seed``, ``device``, knobs of
one notebook) and one mapping per stage section (``SECTIONS``), whose keys are the parameter
names of the stage's builder: the fields of its config dataclass (``train:`` holds
``TrainConfig`` fields) or the keyword arguments of the function that builds its configs.
``seed`` is top-level and reaches every stage that has one.

A field that is a config dataclass itself is a nested section, a mapping under its name
(``study: {train: {...}, capture: {...}, depth: 3}``), built into that dataclass (``nested``).

Notebooks take flat papermill parameters (scalars only), one per profile key: a top-level key
keeps its name; a section key is named as the field it sets, prefixed with its section path
(dots as ``_``) only where another section has a field of the same name
(``parameter_names``: ``capture_max_seq_len``, ``train_max_seq_len``,
``study_train_max_seq_len``, but ``n_prompts``). Tuple fields are comma-separated strings
(``benchmarks: "mtbench,humaneval"``). A notebook builds a stage config from its own parameters
with ``build(section, globals(), ...)``; tests and tools flatten a profile with ``parameters``.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import typing
from collections import Counter
from collections.abc import Mapping
from typing import Any

# section -> "module:builder", imported on first use: importing this module (actwave.index
# does) loads none of the stage modules until a profile is read.
SECTIONS = {
    "capture": "actwave.capture.store:CaptureConfig",        # the analysis split
    "train_capture": "actwave.capture.store:CaptureConfig",  # the train split (notebook 01)
    "analysis": "actwave.stats.analysis:token_settings",
    "selection": "actwave.stats.selection_report:SelectionConfig",
    "train": "actwave.eagle3.train:TrainConfig",
    "eval": "actwave.decoding.evaluate:EvalConfig",
    "study": "actwave.study.runs:StudyConfig",
    "bootstrap": "actwave.stats.sensitivity:BootstrapConfig",
    "longrun": "actwave.study.longrun:LongRunConfig",
}
SHARED = ("seed",)  # top-level keys passed to every builder that takes them
# Builder arguments a notebook sets for each run (the model, the split, a draft's layers,
# an extra token set), never a profile.
PER_RUN = ("model", "split", "layer_ids", "with_special")
Scalar = (str, int, float, bool)


def builder(section: str):
    """The dataclass or function that builds ``section``'s config; a nested section
    (``study.train``) is the dataclass type of that field of its parent's dataclass."""
    parent, _, field = section.rpartition(".")
    if not parent:
        module, name = SECTIONS[section].split(":")
        return getattr(importlib.import_module(module), name)
    return nested(parent)[field]


@functools.cache
def nested(section: str) -> dict[str, type]:
    """{field: dataclass} of ``section``'s fields that are configs themselves: in a profile
    a mapping under the field's name (``study: {train: {...}}``)."""
    made = builder(section)
    if not dataclasses.is_dataclass(made):
        return {}
    hints = typing.get_type_hints(made)
    return {f.name: hints[f.name] for f in dataclasses.fields(made)
            if dataclasses.is_dataclass(hints[f.name])}


@functools.cache
def fields(section: str) -> dict[str, Any]:
    """{key: default} of the scalars a ``section`` of a profile may set
    (``inspect.Parameter.empty``: none); nested sections are in ``nested``."""
    params = inspect.signature(builder(section)).parameters
    return {name: p.default for name, p in params.items()
            if name not in SHARED + PER_RUN + tuple(nested(section))}


def all_sections() -> list[str]:
    """Every section a profile may hold, nested ones by their path (``study.train``)."""
    def walk(section):
        inner = (walk(f"{section}.{field}") for field in nested(section))
        return [section, *(path for paths in inner for path in paths)]
    return [path for section in SECTIONS for path in walk(section)]


@functools.cache
def parameter_names() -> dict[tuple[str, str], str]:
    """{(section, key): notebook parameter}: the key itself, or prefixed with its section
    path (dots as ``_``) where another section has that key or a parameter of that name
    (``study.capture.dtype`` → ``study_capture_dtype`` beside ``capture_dtype``), so every
    name is one (section, key)'s."""
    keys = [(section, key) for section in all_sections() for key in fields(section)]
    owners = Counter(key for _, key in keys)
    names = {(s, k): k if owners[k] == 1 else _prefixed(s, k) for s, k in keys}
    taken = Counter(names.values())
    names = {(s, k): _prefixed(s, k) if taken[name] > 1 else name
             for (s, k), name in names.items()}
    assert len(set(names.values())) == len(names), "two section keys share a parameter name"
    return names


def _prefixed(section: str, key: str) -> str:
    return f"{section.replace('.', '_')}_{key}"


def parameters(profile: Mapping[str, Any]) -> dict[str, Any]:
    """A profile as the flat parameters its notebooks take (module docstring)."""
    flat = {}
    for key, value in profile.items():
        if isinstance(value, Mapping):
            if key not in SECTIONS:
                raise ValueError(f"unknown profile section {key!r}; known: {', '.join(SECTIONS)}")
            flat.update(_section_parameters(key, value))
        elif isinstance(value, Scalar):
            flat[key] = value
        else:
            raise ValueError(f"profile key {key!r}: a scalar or a section, got {value!r}")
    return flat


def _section_parameters(section: str, values: Mapping[str, Any]) -> dict[str, Any]:
    subsections = nested(section)
    unknown = sorted(set(values) - set(fields(section)) - set(subsections))
    if unknown:
        raise ValueError(f"section {section!r}: {unknown} are not parameters of "
                         f"{_described(section)} (it takes {', '.join(fields(section))}"
                         f"{''.join(f', {name}: {{...}}' for name in subsections)})")
    bad = [key for key, value in values.items()
           if not isinstance(value, Mapping if key in subsections else Scalar)]
    if bad:
        mappings = f"; {', '.join(subsections)}: mappings" if subsections else ""
        raise ValueError(f"section {section!r}: {bad} must be scalars (tuples: 'a,b'){mappings}")
    names = parameter_names()
    flat = {names[section, key]: value for key, value in values.items() if key not in subsections}
    for key in (key for key in subsections if key in values):
        flat.update(_section_parameters(f"{section}.{key}", values[key]))
    return flat


def _described(section: str) -> str:
    """``module:builder`` of a top-level section, the dataclass of a nested one."""
    made = builder(section)
    return SECTIONS[section] if section in SECTIONS else f"{made.__module__}:{made.__qualname__}"


def section(values: Mapping[str, Any], name: str) -> dict[str, Any]:
    """{key: value} of section ``name`` among flat ``values`` (a notebook's ``globals()``,
    or ``parameters(profile)``), tuple fields split from their comma-separated strings; a
    nested section whose keys are there as its dataclass, built from them."""
    names = parameter_names()
    found = {key: _typed(values[names[name, key]], default)
             for key, default in fields(name).items() if names[name, key] in values}
    for key, made in nested(name).items():
        inner = section(values, f"{name}.{key}")
        if inner:
            found[key] = made(**inner)
    return found


def _typed(value: Any, default: Any) -> Any:
    """A comma-separated string as a tuple where the field's default is one (items of the
    default's type); any other value as it is."""
    if isinstance(default, tuple) and isinstance(value, str):
        kind = type(default[0]) if default else str
        return tuple(kind(item.strip()) for item in value.split(",") if item.strip())
    return value


def build(name: str, values: Mapping[str, Any], **per_run: Any):
    """Section ``name``'s config from flat ``values`` (see ``section``), the shared keys it
    takes (``seed``) and the per-run arguments (``model``, ``layer_ids`` ...), which override
    a value of the same key (notebook 12 decodes with its own prompt count)."""
    shared = {key: values[key] for key in SHARED if key in values and key in
              inspect.signature(builder(name)).parameters}
    return builder(name)(**{**section(values, name), **shared, **per_run})
