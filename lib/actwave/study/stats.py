"""Statistics of the layer-set study (pure: records and arrays in, numbers and tables out).

A study record (``actwave.study.runs``) holds, per held-out sequence s of one draft (set, seed),
the number of rounds ``roots_s`` and the accepted tokens ``accepted_s``, so
τ̂ = 1 + Σ_s accepted_s / Σ_s roots_s over any subset of sequences (a ratio of sums, as
EAGLE reports τ over a benchmark).

- ``paired_difference``: τ̂(set) − τ̂(reference) on the same held-out sequences, with a
  two-level bootstrap (Davison & Hinkley 1997, §3.8; Ren et al. 2010, "nonparametric
  bootstrapping for hierarchical data"): each replicate resamples the sequences once (shared
  by both arms: the pairing) and, independently per arm, the seeds. A level with fewer than
  ``MIN_UNITS`` units cannot be resampled meaningfully: with fewer seeds the CI is NA and
  the sequence-only CI is given instead, flagged.
- ``rank_correlation``: Spearman ρ and Kendall τ_b with two-sided permutation p-values.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
from scipy import stats as scipy_stats

MIN_UNITS = 3


def arm(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Records of one set (its seeds) -> accepted, roots: (n_seeds, n_sequences) arrays."""
    accepted = np.array([[s["accepted"] for s in r["offline"]["per_sequence"]] for r in records],
                        dtype=np.float64)
    roots = np.array([[s["roots"] for s in r["offline"]["per_sequence"]] for r in records],
                     dtype=np.float64)
    return accepted, roots


def tau_of(accepted: np.ndarray, roots: np.ndarray) -> float:
    """1 + Σ accepted / Σ roots over every cell."""
    return 1.0 + float(accepted.sum() / roots.sum())


def seed_taus(records: list[dict]) -> np.ndarray:
    """τ̂ of each seed of one set: (n_seeds,)."""
    accepted, roots = arm(records)
    return 1.0 + accepted.sum(1) / roots.sum(1)


def _boot_tau(accepted, roots, seed_rows, sequence_cols) -> np.ndarray:
    """τ̂ per replicate: rows (B, n_seeds) and cols (B, n_seq) index one arm's matrix."""
    a = accepted[seed_rows[:, :, None], sequence_cols[:, None, :]].sum((1, 2))
    r = roots[seed_rows[:, :, None], sequence_cols[:, None, :]].sum((1, 2))
    return 1.0 + a / r


def _paired_replicates(set_records: list[dict], reference_records: list[dict],
                       n_bootstrap: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Bootstrap replicates of τ̂(set) − τ̂(reference): (sequence-only (B,), hierarchical
    (B,) or None when either arm has < MIN_UNITS seeds); see ``paired_difference``."""
    acc_a, roots_a = arm(set_records)
    acc_b, roots_b = arm(reference_records)
    if acc_a.shape[1] != acc_b.shape[1] or not np.array_equal(roots_a[0], roots_b[0]):
        raise ValueError("the two arms were scored on different held-out sequences "
                         f"({acc_a.shape[1]} vs {acc_b.shape[1]} sequences or other roots)")
    n_seq = acc_a.shape[1]
    rng = np.random.default_rng(seed)
    cols = rng.integers(0, n_seq, size=(n_bootstrap, n_seq))

    def diffs(seed_a, seed_b):
        return _boot_tau(acc_a, roots_a, seed_a, cols) - _boot_tau(acc_b, roots_b, seed_b, cols)

    fixed_a = np.tile(np.arange(len(acc_a)), (n_bootstrap, 1))
    fixed_b = np.tile(np.arange(len(acc_b)), (n_bootstrap, 1))
    by_sequence = diffs(fixed_a, fixed_b)
    if len(acc_a) < MIN_UNITS or len(acc_b) < MIN_UNITS:
        return by_sequence, None
    return by_sequence, diffs(rng.integers(0, len(acc_a), size=fixed_a.shape),
                              rng.integers(0, len(acc_b), size=fixed_b.shape))


def paired_difference(set_records: list[dict], reference_records: list[dict],
                      n_bootstrap: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """τ̂(set) − τ̂(reference), mean over seeds of each arm, with bootstrap CIs.

    -> {"diff", "ci_low", "ci_high" (hierarchical; NaN when either arm has < MIN_UNITS
    seeds), "seq_ci_low", "seq_ci_high" (sequences resampled, seeds fixed), "n_seeds",
    "n_ref_seeds", "n_sequences"}.
    """
    by_sequence, hierarchical = _paired_replicates(set_records, reference_records,
                                                   n_bootstrap, seed)
    alpha = (1 - level) / 2
    seq_low, seq_high = np.quantile(by_sequence, [alpha, 1 - alpha])
    low = high = math.nan
    if hierarchical is not None:
        low, high = np.quantile(hierarchical, [alpha, 1 - alpha])
    diff = float(seed_taus(set_records).mean() - seed_taus(reference_records).mean())
    return {"diff": diff, "ci_low": float(low), "ci_high": float(high),
            "seq_ci_low": float(seq_low), "seq_ci_high": float(seq_high),
            "n_seeds": len(set_records), "n_ref_seeds": len(reference_records),
            "n_sequences": len(set_records[0]["offline"]["per_sequence"])}


def bootstrap_p(replicates: np.ndarray) -> float:
    """Two-sided bootstrap p of "difference = 0" (the percentile CI inverted): twice the
    smaller share of replicates on either side of 0, each with +1 (never 0), at most 1."""
    n = len(replicates)
    below = (1 + np.sum(replicates <= 0)) / (1 + n)
    above = (1 + np.sum(replicates >= 0)) / (1 + n)
    return float(min(1.0, 2 * min(below, above)))


def paired_test(set_records: list[dict], reference_records: list[dict],
                n_bootstrap: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """``paired_difference`` plus bootstrap p-values from the same replicates: "p"
    (seed × sequence; NaN with < MIN_UNITS seeds in an arm) and "seq_p" (sequences only)."""
    by_sequence, hierarchical = _paired_replicates(set_records, reference_records,
                                                   n_bootstrap, seed)
    return {**paired_difference(set_records, reference_records, n_bootstrap, seed, level),
            "p": math.nan if hierarchical is None else bootstrap_p(hierarchical),
            "seq_p": bootstrap_p(by_sequence)}



def rank_correlation(x, y, n_permutations: int = 10000, seed: int = 0) -> dict:
    """Spearman ρ and Kendall τ_b of x vs y with two-sided permutation p-values.

    -> {"n", "spearman", "spearman_p", "kendall", "kendall_p"}; NaN with fewer than
    MIN_UNITS finite pairs.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    finite = np.isfinite(x) & np.isfinite(y)
    x, y = x[finite], y[finite]
    out = {"n": int(x.size)}
    if x.size < MIN_UNITS:
        return {**out, "spearman": math.nan, "spearman_p": math.nan, "kendall": math.nan,
                "kendall_p": math.nan}
    rng = np.random.default_rng(seed)
    shuffles = [rng.permutation(y) for _ in range(n_permutations)]
    for name, fn in (("spearman", scipy_stats.spearmanr), ("kendall", scipy_stats.kendalltau)):
        observed = float(fn(x, y)[0])
        null = np.array([fn(x, s)[0] for s in shuffles])
        out[name] = observed
        # (1 + #{|null| ≥ |observed|}) / (1 + n): never 0 (Phipson & Smyth 2010)
        out[f"{name}_p"] = float((1 + np.sum(np.abs(null) >= abs(observed) - 1e-12))
                                 / (1 + n_permutations))
    return out


def by_label(records: list[dict]) -> dict[str, list[dict]]:
    """Records grouped by set label, seeds in order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r["label"], r["seed"])):
        groups[record["label"]].append(record)
    return dict(groups)


def set_summary(groups: dict[str, list[dict]]) -> list[dict]:
    """Per set: layers, kind, seeds, τ̂ mean ± SD over seeds (SD NaN for one seed), top-k τ̂
    and the per-step acceptance rates, both averaged over seeds."""
    rows = []
    for label, records in groups.items():
        taus = seed_taus(records)
        topk = np.array([r["offline"]["tau_hat_topk"] for r in records])
        steps = np.array([r["offline"]["step_acceptance"] for r in records]).mean(0)
        rows.append({"label": label, "layer_ids": tuple(records[0]["layer_ids"]),
                     "kind": records[0]["kind"], "k": len(records[0]["layer_ids"]),
                     "n_seeds": len(records), "tau_hat": float(taus.mean()),
                     "tau_hat_sd": float(taus.std(ddof=1)) if len(taus) > 1 else math.nan,
                     "tau_hat_topk": float(topk.mean()),
                     **{f"accept_{i}": float(v) for i, v in enumerate(steps)}})
    return rows


# ----------------------------------------------------------------------------- budgets
# The pre-registered primary comparison of the long runs (``actwave.study.longrun``): the
# EAGLE-3 default vs this set, at the largest budget; every other comparison is Holm-adjusted.
REFERENCE = "eagle3_default"
PRIMARY = "renyi2_exhaustive@filtered"


def holm(p_values) -> list[float]:
    """Holm (1979) step-down adjusted p-values, in input order: the i-th smallest (i from 0)
    of the m finite ones times m − i, made non-decreasing, at most 1; NaN stays NaN."""
    p = np.asarray(p_values, dtype=np.float64)
    out = np.full(p.shape, math.nan)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (order.size - rank) * p[index]))
        out[index] = running
    return out.tolist()


def by_budget(records: list[dict]) -> dict[int, list[dict]]:
    """Long-run records grouped by budget (steps), budgets increasing."""
    groups: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        groups[int(record["budget"])].append(record)
    return dict(sorted(groups.items()))


def complete_budgets(records: list[dict]) -> dict[int, list[dict]]:
    """``by_budget`` restricted to the budgets that hold every (set, seed) of the smallest
    one: while the long runs are under way, a budget with some sets or seeds missing would
    rank sets over different seeds (and a lone record is no ranking)."""
    groups = by_budget(records)
    if not groups:
        return {}
    first = _units(next(iter(groups.values())))
    return {budget: group for budget, group in groups.items() if _units(group) >= first}


def _units(records: list[dict]) -> set[tuple[str, int]]:
    """The (set label, seed) pairs of ``records``."""
    return {(r["label"], int(r["seed"])) for r in records}


def set_means(records: list[dict]) -> dict[str, float]:
    """{label: τ̂ averaged over its seeds} of records of one budget."""
    return {label: float(seed_taus(group).mean()) for label, group in by_label(records).items()}


def rank_stability(records: list[dict], n_permutations: int = 10000, seed: int = 0
                   ) -> list[dict]:
    """Per pair of successive budgets: Spearman ρ and Kendall τ_b (permutation p) between the
    sets' rankings by mean τ̂ over seeds, over the sets scored at both budgets; budgets
    still missing records are left out (``complete_budgets``).

    -> rows {"budget", "next_budget", "n", "spearman", "spearman_p", "kendall", "kendall_p"}.
    """
    means = {budget: set_means(group) for budget, group in complete_budgets(records).items()}
    budgets = list(means)
    rows = []
    for budget, following in zip(budgets, budgets[1:]):
        labels = sorted(set(means[budget]) & set(means[following]))
        x = [means[budget][label] for label in labels]
        y = [means[following][label] for label in labels]
        rows.append({"budget": budget, "next_budget": following,
                     **rank_correlation(x, y, n_permutations, seed)})
    return rows


def rank_vs_largest(records: list[dict], n_permutations: int = 10000, seed: int = 0,
                    alpha: float = 0.05) -> list[dict]:
    """Does the ranking at a budget predict the ranking at the largest one? Per smaller
    budget: Spearman ρ and Kendall τ_b (permutation p) between the sets' mean τ̂ there and at
    the largest complete budget (``complete_budgets``); ``predicts`` when ρ > 0 with
    p < ``alpha``. The smallest budget from which every budget predicts is the one a short
    validation can use (``actwave.tools.validate``).

    -> rows {"budget", "versus" (the largest budget), "n", "spearman", "spearman_p",
    "kendall", "kendall_p", "predicts"}.
    """
    means = {budget: set_means(group) for budget, group in complete_budgets(records).items()}
    if not means:
        return []
    largest = max(means)
    rows = []
    for budget in sorted(b for b in means if b != largest):
        labels = sorted(set(means[budget]) & set(means[largest]))
        found = rank_correlation([means[budget][label] for label in labels],
                                 [means[largest][label] for label in labels],
                                 n_permutations, seed)
        rows.append({"budget": budget, "versus": largest, **found,
                     "predicts": bool(found["spearman"] > 0 and found["spearman_p"] < alpha)})
    return rows


def budget_curves(records: list[dict]) -> list[dict]:
    """τ̂ vs budget per set, with its seed band: rows {"label", "budget", "tokens" (mean
    training tokens), "n_seeds", "tau_hat" (mean), "tau_hat_sd" (NaN for one seed),
    "tau_hat_min", "tau_hat_max"}, by label then budget."""
    rows = []
    for budget, group in by_budget(records).items():
        for label, seeds in by_label(group).items():
            taus = seed_taus(seeds)
            rows.append({"label": label, "budget": budget,
                         "tokens": float(np.mean([r["training"]["tokens"] for r in seeds])),
                         "n_seeds": len(seeds), "tau_hat": float(taus.mean()),
                         "tau_hat_sd": float(taus.std(ddof=1)) if len(taus) > 1 else math.nan,
                         "tau_hat_min": float(taus.min()), "tau_hat_max": float(taus.max())})
    return sorted(rows, key=lambda row: (row["label"], row["budget"]))


def budget_comparisons(records: list[dict], reference: str = REFERENCE, primary: str = PRIMARY,
                       n_bootstrap: int = 2000, seed: int = 0) -> list[dict]:
    """Every set vs ``reference`` at every budget (``paired_test``), CSV-ready rows.

    "p" is the seed × sequence bootstrap p, or the sequence-only one where an arm has fewer
    than MIN_UNITS seeds ("p_level" says which). "p_holm" adjusts, per budget, every set
    but the pre-registered primary comparison (``primary`` at the largest budget), whose
    p is reported as is ("primary" True).
    """
    groups = by_budget(records)
    largest = max(groups) if groups else None
    rows = []
    for budget, group in groups.items():
        sets = by_label(group)
        if reference not in sets:
            continue
        found = []
        for label, arm_records in sets.items():
            if label == reference:
                continue
            test = paired_test(arm_records, sets[reference], n_bootstrap, seed)
            hierarchical = math.isfinite(test["p"])
            found.append({"budget": budget, "label": label, **test,
                          "p": test["p"] if hierarchical else test["seq_p"],
                          "p_level": "seed×sequence" if hierarchical else "sequence",
                          "primary": label == primary and budget == largest})
        family = [row for row in found if not row["primary"]]
        for row, adjusted in zip(family, holm([row["p"] for row in family])):
            row["p_holm"] = adjusted
        for row in found:
            row.setdefault("p_holm", row["p"])
        rows += found
    return rows
