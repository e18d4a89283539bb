"""Figures and tables for the notebooks: fixed style, byte-stable files, manifests.

Every figure is written as PNG and PDF under ``figures/`` (or ``$ACTWAVE_FIGURES``) and
listed in ``figures/MANIFEST.json`` with the notebook that made it; every table is written
as CSV and Markdown under ``results/<profile>/`` and listed in that folder's
``MANIFEST.json``. Reruns on equal data give byte-identical files: PDF/SVG dates are
dropped, the SVG hash salt is fixed, floats are written with a fixed format and table rows
are sorted.

Plot helpers take arrays, tensors or DataFrames and return the ``Figure``; they never
save. Works under any backend (the Agg backend headless, inline in notebooks).
"""
from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from actwave import config
from actwave.stats import selection

FIGURE_FORMATS = ("png", "pdf")
FIGURE_DPI = 150
FLOAT_FORMAT = "%.6g"
MANIFEST_NAME = "MANIFEST.json"
# Metadata that would change between runs (dates) or between installs (versions).
_SAVE_METADATA = {
    "png": {"Software": None},
    "pdf": {"CreationDate": None, "ModDate": None, "Producer": None, "Creator": "actwave"},
    "svg": {"Date": None, "Creator": "actwave"},
}


# ----------------------------------------------------------------------------- style
def setup_style() -> None:
    """Fixed seaborn/matplotlib defaults so figures look and hash the same everywhere."""
    sns.set_theme(context="paper", style="whitegrid", palette="colorblind",
                  font="DejaVu Sans")
    mpl.rcParams.update({
        "figure.dpi": FIGURE_DPI,
        "savefig.dpi": FIGURE_DPI,
        "savefig.bbox": "tight",
        "svg.hashsalt": "actwave",
        "svg.fonttype": "path",
        "pdf.fonttype": 42,
        "figure.autolayout": False,
        "axes.titlesize": 10,
        "axes.labelsize": 9,
        "legend.fontsize": 8,
    })


# ----------------------------------------------------------------------------- files
def default_figures_dir() -> Path:
    """Where figures go: ``$ACTWAVE_FIGURES`` if set (a relative path is taken from the repo
    root, not from the notebook's working directory), else ``<repo>/figures``."""
    override = os.environ.get("ACTWAVE_FIGURES")
    return config.repo_root() / (override or "figures")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name \
            or name.startswith("."):
        raise ValueError(f"artifact name must be a plain file stem, got {name!r}")


def record_in_manifest(directory: Path, name: str, notebook: str, files: Sequence[Path]) -> Path:
    """Add/replace ``name`` in ``directory/MANIFEST.json`` (merged, sorted, atomic)."""
    path = Path(directory) / MANIFEST_NAME
    entries = json.loads(path.read_text()) if path.exists() else {}
    entries[name] = {"notebook": notebook,
                     "files": sorted(Path(f).name for f in files)}
    config.atomic_write_json(path, entries)
    return path


def figure_bytes(fig: Figure, fmt: str) -> bytes:
    """The figure rendered to ``fmt`` with run-independent metadata."""
    if fmt not in _SAVE_METADATA:
        raise ValueError(f"figure format {fmt!r} not supported; use one of "
                         f"{sorted(_SAVE_METADATA)}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=FIGURE_DPI, bbox_inches="tight",
                metadata=_SAVE_METADATA[fmt])
    return buffer.getvalue()


def save_figure(fig: Figure, name: str, notebook: str,
                figures_dir: Path | None = None) -> list[Path]:
    """Write ``<dir>/<name>.png`` and ``.pdf`` atomically and list them in the manifest.

    ``figures_dir`` defaults to :func:`default_figures_dir` (``$ACTWAVE_FIGURES`` or
    ``<repo>/figures``). Returns the written paths.
    """
    _check_name(name)
    directory = Path(figures_dir) if figures_dir is not None else default_figures_dir()
    paths = []
    for fmt in FIGURE_FORMATS:
        path = directory / f"{name}.{fmt}"
        config.atomic_write_bytes(path, figure_bytes(fig, fmt))
        paths.append(path)
    record_in_manifest(directory, name, notebook, paths)
    return paths


def _sorted_rows(df: pd.DataFrame, sort_by: Sequence[str] | None) -> pd.DataFrame:
    """Rows in a deterministic order (stable sort on ``sort_by``, default all columns)."""
    columns = list(df.columns) if sort_by is None else list(sort_by)
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"sort_by columns {missing} not in table columns {list(df.columns)}")
    if not columns:
        return df.reset_index(drop=True)

    def sort_key(column: pd.Series) -> pd.Series:
        # Mixed/object columns (strings, tuples) sort by their text.
        return column if pd.api.types.is_numeric_dtype(column) else column.astype(str)

    return df.sort_values(columns, key=sort_key, kind="mergesort").reset_index(drop=True)


def _format_cell(value: Any, float_format: str) -> str:
    if isinstance(value, (float, np.floating)):
        return "" if math.isnan(value) else float_format % value
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def to_markdown(df: pd.DataFrame, float_format: str = FLOAT_FORMAT) -> str:
    """A GitHub-style Markdown table (numbers right-aligned), no extra dependency."""
    header = [str(c) for c in df.columns]
    rows = [[_format_cell(v, float_format) for v in row]
            for row in df.itertuples(index=False, name=None)]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    escape = [[cell.replace("|", "\\|") for cell in row] for row in [header, *rows]]
    widths = [max(3, *(len(r[i]) for r in escape)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if num else c.ljust(w)
                  for c, w, num in zip(cells, widths, numeric)]
        return "| " + " | ".join(padded) + " |"

    rule = "| " + " | ".join(("-" * (w - 1) + ":") if num else "-" * w
                             for w, num in zip(widths, numeric)) + " |"
    return "\n".join([line(escape[0]), rule, *(line(r) for r in escape[1:])]) + "\n"


def save_table(df: pd.DataFrame, name: str, notebook: str, results_dir: Path,
               sort_by: Sequence[str] | None = None,
               float_format: str = FLOAT_FORMAT) -> list[Path]:
    """Write ``<results_dir>/<name>.csv`` and ``.md`` byte-stably; list them in the manifest.

    Rows are stably sorted by ``sort_by`` (default: all columns left to right; ``[]``
    keeps the given order); floats use ``float_format``; list/tuple cells become
    ``"a,b,c"``. Returns the written paths.
    """
    _check_name(name)
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"save_table needs a pandas DataFrame, got {type(df).__name__}")
    table = _sorted_rows(df, sort_by)
    as_text = table.map(lambda v: _format_cell(v, float_format)
                        if isinstance(v, (list, tuple)) else v)
    csv_text = as_text.to_csv(index=False, float_format=float_format, lineterminator="\n")
    directory = Path(results_dir)
    paths = [directory / f"{name}.csv", directory / f"{name}.md"]
    config.atomic_write_bytes(paths[0], csv_text.encode())
    config.atomic_write_bytes(paths[1], to_markdown(table, float_format).encode())
    record_in_manifest(directory, name, notebook, paths)
    return paths


def save_json(obj: Any, name: str, notebook: str, results_dir: Path) -> Path:
    """Write ``<results_dir>/<name>.json`` (sorted keys, atomic); list it in the manifest."""
    _check_name(name)
    path = Path(results_dir) / f"{name}.json"
    config.atomic_write_json(path, obj)
    record_in_manifest(Path(results_dir), name, notebook, [path])
    return path


def layer_table(stats: Any, **labels: Any) -> pd.DataFrame:
    """Long-form per-layer table of a ``LayerStats``: ``labels``, layer, entropies, tokens.

    ``entropy_norm`` = H₁ / log min(n, d), the fraction of the maximal entropy.
    """
    bound = math.log(max(2, min(int(stats.n_tokens), int(stats.dim))))
    entropy = as_numpy(stats.entropy)
    table = pd.DataFrame({"layer": [int(v) for v in stats.layers], "entropy": entropy,
                          "renyi2": as_numpy(stats.renyi2), "entropy_norm": entropy / bound,
                          "n_tokens": int(stats.n_tokens)})
    for position, (name, value) in enumerate(labels.items()):
        table.insert(position, name, value)
    return table


# ----------------------------------------------------------------------------- plots
def as_numpy(values: Any) -> np.ndarray:
    """Tensors (any device), arrays and sequences as a float64 numpy array."""
    if hasattr(values, "detach"):
        values = values.detach().to("cpu").double().numpy()
    return np.asarray(values, dtype=np.float64)


def _new_axes(ax: plt.Axes | None, figsize: tuple[float, float]) -> tuple[Figure, plt.Axes]:
    if ax is not None:
        return ax.figure, ax
    fig, new_ax = plt.subplots(figsize=figsize)
    return fig, new_ax


def plot_layer_curves(data: pd.DataFrame, y: str, x: str = "layer", hue: str | None = None,
                      style: str | None = None, col: str | None = None,
                      marked_layers: Mapping[str, Sequence[int]] | Sequence[int] | None = None,
                      ylabel: str | None = None, title: str | None = None,
                      sharey: bool = False) -> Figure:
    """Line plot of a per-layer statistic against depth, one panel per value of ``col``.

    data: long-form table with columns ``x`` (layer index), ``y`` and optional ``hue``,
    ``style``, ``col``. marked_layers: layers drawn as dotted verticals (e.g. the EAGLE-3
    default), either one list for all panels or ``{col value: layers}``.
    """
    missing = [c for c in (x, y, hue, style, col) if c is not None and c not in data.columns]
    if missing:
        raise ValueError(f"columns {missing} not in data columns {list(data.columns)}")
    panels = list(dict.fromkeys(data[col])) if col else [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2),
                             sharey=sharey, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        subset = data if panel is None else data[data[col] == panel]
        sns.lineplot(data=subset, x=x, y=y, hue=hue, style=style, markers=True,
                     dashes=True, ax=ax, legend=ax is axes[0][-1])
        marks = marked_layers.get(panel, ()) if isinstance(marked_layers, Mapping) \
            else (marked_layers or ())
        for layer in marks:
            ax.axvline(layer, color="0.4", linestyle=":", linewidth=1)
        ax.set_title(str(panel) if panel is not None else (title or ""))
        ax.set_xlabel("layer ℓ (blocks applied)")
        ax.set_ylabel(ylabel or y)
    if axes[0][-1].get_legend() is not None:
        sns.move_legend(axes[0][-1], "upper left", bbox_to_anchor=(1.02, 1))
    if title and col:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _layer_ticks(ax: plt.Axes, layers: Sequence[int], marked: Sequence[int] = ()) -> None:
    """Label every layer when few, else every few, plus the marked ones (in green)."""
    step = max(1, len(layers) // 12)
    marked_positions = {layers.index(layer) for layer in marked}
    # Regular ticks too close to a marked one would overprint it.
    regular = {p for p in range(0, len(layers), step)
               if all(abs(p - m) >= max(2, step) for m in marked_positions)}
    positions = sorted(regular | marked_positions)
    labels = [str(layers[i]) for i in positions]
    ax.set_xticks(np.array(positions) + 0.5, labels, rotation=0)
    ax.set_yticks(np.array(positions) + 0.5, labels, rotation=0)
    for tick_labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        for position, label in zip(positions, tick_labels):
            if position in marked_positions:
                label.set_color("tab:green")
                label.set_fontweight("bold")


def plot_cka_heatmap(cka: Any, compartments: Sequence[tuple[int, int]] | None = None,
                     marked_layers: Sequence[int] | None = None, title: str = "linear CKA",
                     layers: Sequence[int] | None = None, vmin: float = 0.0, vmax: float = 1.0,
                     ax: plt.Axes | None = None) -> Figure:
    """Heatmap of an (L, L) layer-similarity matrix with compartments boxed.

    compartments: (first, last) layer indices, inclusive, of contiguous blocks, drawn as
    boxes on the diagonal (``selection.compartment_layers`` gives them as layer indices;
    ``metrics.compartments`` gives row positions, equal when ``layers`` is 0..L-1).
    layers: the layer index of each row (default 0..L-1).
    marked_layers: layers whose diagonal cell is boxed and tick label shown in green
    (e.g. the EAGLE-3 default set).
    """
    matrix = as_numpy(cka)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"cka must be a square (L, L) matrix, got shape {matrix.shape}")
    layers = list(range(matrix.shape[0])) if layers is None else [int(v) for v in layers]
    if len(layers) != matrix.shape[0]:
        raise ValueError(f"{len(layers)} layer labels for a {matrix.shape[0]}-layer matrix")
    position = {layer: i for i, layer in enumerate(layers)}
    fig, ax = _new_axes(ax, (4.6, 4.0))
    sns.heatmap(matrix, vmin=vmin, vmax=vmax, cmap="magma", square=True, ax=ax,
                cbar_kws={"shrink": 0.8})
    ax.grid(False)
    marked = [int(v) for v in marked_layers or ()]
    _layer_ticks(ax, layers, marked)
    for first, last in compartments or ():
        start, stop = position[int(first)], position[int(last)] + 1
        ax.add_patch(Rectangle((start, start), stop - start, stop - start, fill=False,
                               edgecolor="cyan", linewidth=1.5))
    for layer in marked:
        ax.add_patch(Rectangle((position[layer], position[layer]), 1, 1, fill=False,
                               edgecolor="tab:green", linewidth=1.5))
    ax.set_xlabel("layer ℓ")
    ax.set_ylabel("layer ℓ")
    ax.set_title(title)
    return fig


def plot_pair_heatmap(pair_scores: Any, layers: Sequence[int] | None = None,
                      marked_pairs: Sequence[tuple[int, int]] = (), title: str = "",
                      cbar_label: str = "aggregate entropy (nats)",
                      ax: plt.Axes | None = None) -> Figure:
    """Upper-triangle heatmap of a symmetric (L, L) score over layer pairs (i < j).

    The diagonal and lower triangle are masked; ``marked_pairs`` (layer indices) get a box
    and their layers green tick labels.
    """
    matrix = as_numpy(pair_scores)
    layers = list(range(matrix.shape[0])) if layers is None else [int(v) for v in layers]
    if matrix.shape != (len(layers), len(layers)):
        raise ValueError(f"pair_scores shape {matrix.shape} does not match {len(layers)} layers")
    position = {layer: i for i, layer in enumerate(layers)}
    mask = ~np.triu(np.ones_like(matrix, dtype=bool), k=1)
    fig, ax = _new_axes(ax, (4.6, 4.0))
    sns.heatmap(matrix, mask=mask, cmap="viridis", square=True, ax=ax,
                cbar_kws={"shrink": 0.8, "label": cbar_label})
    ax.grid(False)
    _layer_ticks(ax, layers, sorted({int(v) for pair in marked_pairs for v in pair}))
    for a, b in marked_pairs:
        row, column = sorted((position[a], position[b]))
        ax.add_patch(Rectangle((column, row), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    ax.set_xlabel("layer j")
    ax.set_ylabel("layer i")
    ax.set_title(title)
    return fig


def plot_subset_distribution(scores: Any, marks: Mapping[str, float], xlabel: str = "score",
                             title: str = "", bins: int = 60,
                             ax: plt.Axes | None = None) -> Figure:
    """Histogram of a score over all subsets with labelled verticals at ``marks``.

    scores: (S,) one score per subset. marks: {label: score of that set}; each line is
    labelled with the share of subsets scoring at most that value (its percentile).
    """
    values = as_numpy(scores).ravel()
    if values.size == 0:
        raise ValueError("scores is empty: nothing to plot")
    fig, ax = _new_axes(ax, (5.2, 3.2))
    ax.hist(values, bins=bins, color="0.7", edgecolor="0.5", linewidth=0.3)
    palette = sns.color_palette("colorblind", n_colors=max(1, len(marks)))
    for color, (label, score) in zip(palette, marks.items()):
        share = selection.percentile(score, torch.from_numpy(values))
        ax.axvline(score, color=color, linewidth=1.5, label=f"{label} ({share:.1f}%)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("number of subsets")
    ax.set_title(title)
    if marks:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    return fig


def plot_method_scores(table: pd.DataFrame, method: str = "method", value: str = "percentile",
                       hue: str | None = None, col: str | None = None,
                       xlabel: str | None = None, title: str = "") -> Figure:
    """Dot plot of one number per selection method (e.g. percentile among all subsets).

    table: long-form with columns ``method``, ``value`` and optional ``hue`` (e.g. the
    token set) and ``col`` (one panel per model).
    """
    missing = [c for c in (method, value, hue, col) if c is not None and c not in table.columns]
    if missing:
        raise ValueError(f"columns {missing} not in table columns {list(table.columns)}")
    panels = list(dict.fromkeys(table[col])) if col else [None]
    order = list(dict.fromkeys(table[method]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 0.35 * len(order) + 1.2),
                             sharex=True, sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        subset = table if panel is None else table[table[col] == panel]
        sns.stripplot(data=subset, x=value, y=method, hue=hue, order=order, dodge=False,
                      size=7, jitter=False, ax=ax, legend=ax is axes[0][-1])
        ax.set_title("" if panel is None else str(panel))
        ax.set_xlabel("")
        ax.set_ylabel("")
    if axes[0][-1].get_legend() is not None:
        sns.move_legend(axes[0][-1], "upper left", bbox_to_anchor=(1.02, 1))
    fig.supxlabel(xlabel or value, fontsize=mpl.rcParams["axes.labelsize"])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _require(table: pd.DataFrame, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ValueError(f"columns {missing} not in table columns {list(table.columns)}")


def plot_training_curves(curves: pd.DataFrame, held_out: pd.DataFrame, title: str = "") -> Figure:
    """Draft training of one model: smoothed loss, then held-out agreement per TTT step.

    curves: long-form ``step``, ``loss_smooth``, ``label`` (one line per layer set);
    held_out: long-form ``step``, ``ttt_step`` ("acc_0", "acc_1", ...), ``top1_agreement``,
    ``label``. One panel for the loss and one per TTT step, sharing a legend.
    """
    _require(curves, ["step", "loss_smooth", "label"])
    _require(held_out, ["step", "ttt_step", "top1_agreement", "label"])
    positions = sorted(set(held_out["ttt_step"]), key=lambda name: int(name.split("_")[-1]))
    fig, axes = plt.subplots(1, 1 + len(positions), figsize=(3.6 * (1 + len(positions)), 3.2),
                             squeeze=False)
    sns.lineplot(data=curves, x="step", y="loss_smooth", hue="label", ax=axes[0][0],
                 legend=False)
    axes[0][0].set(title="train loss Σ γ^i CE_i", ylabel="loss")
    for i, position in enumerate(positions):
        sns.lineplot(data=held_out[held_out["ttt_step"] == position], x="step",
                     y="top1_agreement", hue="label", marker="o", ax=axes[0][1 + i],
                     legend=i == len(positions) - 1)
        axes[0][1 + i].set(title=f"held-out top-1, TTT step {i}", ylim=(0, None))
    sns.move_legend(axes[0][-1], "upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_tau_vs_score(joined: pd.DataFrame) -> Figure:
    """Measured τ against each selection score: one panel per score (columns) and token
    set (rows); points are trained drafts (``label``), marker style by ``model``.

    joined: long-form ``value``, ``tau``, ``label``, ``model``, ``score``, ``token_set``.
    """
    _require(joined, ["value", "tau", "label", "model", "score", "token_set"])
    grid = sns.relplot(data=joined, x="value", y="tau", hue="label", style="model",
                       col="score", row="token_set", kind="scatter", height=2.6,
                       facet_kws={"sharex": False})
    grid.set_titles("{row_name} · {col_name}")
    grid.set_axis_labels("selection score", "τ (all benchmarks)")
    grid.figure.suptitle("measured τ vs selection score per trained draft", y=1.02)
    return grid.figure


def plot_acceptance(acceptance: pd.DataFrame, title: str = "") -> Figure:
    """Acceptance per draft position of one model: rows ``reach`` and ``conditional``,
    one column per benchmark, one line per label.

    acceptance: ``benchmark``, ``label``, ``position``, ``reach``, ``conditional``.
    """
    _require(acceptance, ["benchmark", "label", "position", "reach", "conditional"])
    rates = acceptance.melt(id_vars=["benchmark", "label", "position"],
                            value_vars=["reach", "conditional"], var_name="rate",
                            value_name="value")
    grid = sns.relplot(data=rates, x="position", y="value", hue="label", col="benchmark",
                       row="rate", kind="line", marker="o", height=2.6)
    grid.set_titles("{col_name} · {row_name}")
    grid.set(ylim=(0, 1.02))
    grid.set_axis_labels("draft position i", "acceptance")
    grid.figure.suptitle(title, y=1.02)
    return grid.figure
