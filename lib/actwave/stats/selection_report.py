"""Reports on layer selection: compare methods, explain a set, tabulate pair and top scores.

Built on the pure search and objectives of ``actwave.stats.selection`` (notebooks 03–05 call
these); like it, pure functions on ``layerstats.LayerStats`` tensors: no I/O, no printing.
``SelectionConfig`` is the selection stage's (notebook 05) config.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from actwave.integrity import Between, check_fields
from actwave.stats.selection import (METHODS, ScoreFn, all_subsets, check_k, cka_matrix,
                                     compartment_layers, exhaustive, objective, percentile,
                                     resolve_candidates, score_of, select)

# The drafts notebook 06 trains, by label: (token set the layers were picked on, method);
# None = the config's ``combined_method``. The entropy+CKA sets with and without token
# filtering, single-criterion contrasts, the EAGLE-3 default and an adjacent-early control.
DRAFT_SOURCES = {
    "eagle3_default": ("unfiltered", "eagle3_default"),
    "entropy_cka_filtered": ("filtered", None),
    "entropy_cka_unfiltered": ("unfiltered", None),
    "entropy_only": ("filtered", "entropy_topk"),
    "cka_only": ("filtered", "cka_farthest"),
    "control_adjacent_early": ("unfiltered", "first_k"),
}


@dataclass
class SelectionConfig:
    """The selection stage (notebook 05): set size, method options, what goes to training.

    ``combined_method``: the entropy+CKA method whose sets are trained (with and without
    token filtering); ``competitive_percentile``: a set at or above this H₂ percentile
    counts as competitive with the best.
    """

    k: int = 3
    greedy_alpha: float = 1.0
    mrmr_lambda: float = 1.0
    dpp_theta: float = 1.0
    combined_method: str = "renyi2_exhaustive"
    competitive_percentile: float = 90.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, {"greedy_alpha": Between(0.0), "mrmr_lambda": Between(0.0),
                            "dpp_theta": Between(0.0, low_open=True),
                            "seed": Between(0)})
        if self.combined_method not in METHODS:
            raise ValueError(f"combined_method {self.combined_method!r} unknown; "
                             f"known: {sorted(METHODS)}")
        check_k(self.k, 10**9)

    def methods(self) -> dict[str, tuple[str, dict]]:
        """Every method of ``METHODS`` with this config's options, labelled by its name."""
        options = {"random": {"seed": self.seed},
                   "greedy_aggregate_entropy": {"alpha": self.greedy_alpha},
                   "logdet_dpp": {"theta": self.dpp_theta}, "mrmr": {"lam": self.mrmr_lambda}}
        return {name: (name, options.get(name, {})) for name in METHODS}

    def candidate_sets(self, unfiltered: Mapping[str, Sequence[int]],
                       filtered: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """{draft label: layers} of ``DRAFT_SOURCES``, from each method's picks
        ({method label: layers}) on all tokens (``unfiltered``) and top-entropy tokens."""
        picks = {"unfiltered": unfiltered, "filtered": filtered}
        return {label: [int(v) for v in picks[token_set][method or self.combined_method]]
                for label, (token_set, method) in DRAFT_SOURCES.items()}


def pairwise_scores(score_fn: ScoreFn, layers: Sequence[int]) -> Tensor:
    """Symmetric ``(n, n)`` matrix of a set score over all pairs of ``layers`` (NaN diagonal)."""
    layers = [int(v) for v in layers]
    pairs = all_subsets(layers, 2)  # (P, 2)
    scores = score_fn(pairs).to("cpu", torch.float64)  # (P,)
    position = {layer: i for i, layer in enumerate(layers)}
    matrix = torch.full((len(layers), len(layers)), math.nan, dtype=torch.float64)
    rows = torch.tensor([position[a] for a in pairs[:, 0].tolist()])
    cols = torch.tensor([position[b] for b in pairs[:, 1].tolist()])
    matrix[rows, cols] = scores
    matrix[cols, rows] = scores
    return matrix


def compare_methods(stats: Any, methods: Mapping[str, tuple[str, dict]], k: int = 3,
                    candidates: Sequence[int] | None = None,
                    objectives: Sequence[str] = ("renyi2", "logdet", "entropy_sum",
                                                 "dispersion")) -> list[dict]:
    """Each method's set, its score under each objective and its percentile among all sets.

    methods: ``{label: (method name, options)}``. Returns one record per label:
    ``{"label", "method", "layers", "<objective>", "<objective>_pct", ...}`` where the
    percentile is the share of all C(n, k) candidate subsets scoring at most as well.
    """
    pool = resolve_candidates(stats, candidates)
    scored = {name: exhaustive(objective(name, stats), pool, k) for name in objectives}
    records = []
    for label, (method, options) in methods.items():
        layers = select(method, stats, k=k, candidates=pool, **options)
        record = {"label": label, "method": method, "layers": layers}
        for name, (_, subsets, scores) in scored.items():
            value = score_of(layers, subsets, scores) if set(layers) <= set(pool) else math.nan
            record[name] = value
            record[f"{name}_pct"] = percentile(value, scores) if not math.isnan(value) else math.nan
        records.append(record)
    return records


def top_subsets(subsets: Tensor, scores: Tensor, n: int,
                include: Sequence[Sequence[int]] = ()) -> Tensor:
    """The ``n`` best-scoring rows of ``subsets: (S, k)`` plus any ``include`` sets, best first.

    Ties keep the enumeration order; an ``include`` set already among the top is not repeated.
    """
    order = torch.sort(scores.cpu(), descending=True, stable=True).indices[:n]
    chosen = [tuple(row) for row in subsets[order].tolist()]
    extra = [tuple(sorted(int(v) for v in s)) for s in include]
    chosen += [s for s in dict.fromkeys(extra) if s not in chosen]
    return torch.tensor(chosen, dtype=torch.long).reshape(-1, subsets.shape[1])  # (n', k)


def off_diagonal_mean(matrix: Tensor) -> Tensor:
    """Mean of the off-diagonal entries of a square ``(L, L)`` matrix (e.g. CKA)."""
    matrix = torch.as_tensor(matrix)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] < 2:
        raise ValueError(f"need a square (L, L) matrix with L ≥ 2, got {tuple(matrix.shape)}")
    off = ~torch.eye(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    return matrix[off].mean()


def set_profile(stats: Any, layers: Sequence[int], candidates: Sequence[int] | None = None,
                debiased: bool = True) -> dict:
    """Why a set scores as it does: entropy ranks, redundancy, compartments covered.

    ``entropy_ranks``: rank of each layer's Shannon entropy among the candidates (1 = the
    highest, 0 = not a candidate); ``mean_cka`` / ``max_cka``: over the set's pairs;
    ``compartments_hit``: how many of the ``compartment_layers`` blocks the set touches, of
    ``n_compartments``.
    """
    pool = resolve_candidates(stats, candidates)
    layers = sorted(int(v) for v in layers)
    order = torch.sort(stats.entropy[stats.rows(list(pool))].cpu(), descending=True,
                       stable=True).indices.tolist()
    rank = {pool[i]: r + 1 for r, i in enumerate(order)}
    rows = stats.rows(layers)
    block = cka_matrix(stats, debiased)[rows[:, None], rows[None, :]].cpu()  # (k, k)
    pair_values = block[torch.triu(torch.ones_like(block, dtype=torch.bool), diagonal=1)]
    blocks = compartment_layers(stats, debiased=debiased)
    hit = {i for i, (first, last) in enumerate(blocks) for v in layers if first <= v <= last}
    return {"layers": tuple(layers), "entropy_ranks": tuple(rank.get(v, 0) for v in layers),
            "mean_cka": float(pair_values.mean()) if pair_values.numel() else math.nan,
            "max_cka": float(pair_values.max()) if pair_values.numel() else math.nan,
            "compartments_hit": len(hit), "n_compartments": len(blocks)}


def explain_default(stats: Any, rows: Sequence[Mapping], config: SelectionConfig) -> str:
    """Whether the EAGLE-3 default set is competitive, and why, as one Markdown sentence.

    ``rows``: ``compare_methods`` rows of one model and token set (with ``eagle3_default``
    and ``config.combined_method``); ``stats``: that token set's ``LayerStats``. Compares
    the default with the combined method's set: H₂ percentile, entropy ranks, mean
    pairwise CKA and compartments spanned (``set_profile``).
    """
    by_label = {row["label"]: row for row in rows}
    default = set_profile(stats, by_label["eagle3_default"]["layers"])
    best = set_profile(stats, by_label[config.combined_method]["layers"])
    pct = by_label["eagle3_default"]["renyi2_pct"]
    verdict = "competitive" if pct >= config.competitive_percentile else "not competitive"
    less_informative = sum(default["entropy_ranks"]) > sum(best["entropy_ranks"])
    more_redundant = default["mean_cka"] > best["mean_cka"]
    return (f"the default {default['layers']} is **{verdict}** — H₂ percentile {pct:.1f} "
            f"({config.combined_method} set {best['layers']}). Entropy ranks of its layers "
            f"{default['entropy_ranks']} vs {best['entropy_ranks']}; mean pairwise CKA "
            f"{default['mean_cka']:.2f} vs {best['mean_cka']:.2f}; it spans "
            f"{default['compartments_hit']} of {default['n_compartments']} compartments "
            f"(vs {best['compartments_hit']}). Relative to that set its layers are "
            f"{'less' if less_informative else 'no less'} informative and "
            f"{'more' if more_redundant else 'no more'} redundant.")
