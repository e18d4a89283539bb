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


def paired_difference(set_records: list[dict], reference_records: list[dict],
                      n_bootstrap: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """τ̂(set) − τ̂(reference), mean over seeds of each arm, with bootstrap CIs.

    -> {"diff", "ci_low", "ci_high" (hierarchical; NaN when either arm has < MIN_UNITS
    seeds), "seq_ci_low", "seq_ci_high" (sequences resampled, seeds fixed), "n_seeds",
    "n_ref_seeds", "n_sequences"}.
    """
    acc_a, roots_a = arm(set_records)
    acc_b, roots_b = arm(reference_records)
    if acc_a.shape[1] != acc_b.shape[1] or not np.array_equal(roots_a[0], roots_b[0]):
        raise ValueError("the two arms were scored on different held-out sequences "
                         f"({acc_a.shape[1]} vs {acc_b.shape[1]} sequences or other roots)")
    n_seq = acc_a.shape[1]
    rng = np.random.default_rng(seed)
    cols = rng.integers(0, n_seq, size=(n_bootstrap, n_seq))
    alpha = (1 - level) / 2

    def ci(seed_a, seed_b):
        diffs = (_boot_tau(acc_a, roots_a, seed_a, cols) - _boot_tau(acc_b, roots_b, seed_b, cols))
        return np.quantile(diffs, [alpha, 1 - alpha])

    fixed_a = np.tile(np.arange(len(acc_a)), (n_bootstrap, 1))
    fixed_b = np.tile(np.arange(len(acc_b)), (n_bootstrap, 1))
    seq_low, seq_high = ci(fixed_a, fixed_b)
    low = high = math.nan
    if len(acc_a) >= MIN_UNITS and len(acc_b) >= MIN_UNITS:
        low, high = ci(rng.integers(0, len(acc_a), size=fixed_a.shape),
                       rng.integers(0, len(acc_b), size=fixed_b.shape))
    diff = float(seed_taus(set_records).mean() - seed_taus(reference_records).mean())
    return {"diff": diff, "ci_low": float(low), "ci_high": float(high),
            "seq_ci_low": float(seq_low), "seq_ci_high": float(seq_high),
            "n_seeds": len(acc_a), "n_ref_seeds": len(acc_b), "n_sequences": n_seq}


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
