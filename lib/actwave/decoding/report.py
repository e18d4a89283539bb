"""Reports of decoding runs and the layer-set study's score joins: statistics and tables.

Statistics (``summarize``): τ = Σ emitted / Σ verification rounds (EAGLE), tokens/s =
Σ tokens / Σ seconds, speedup = tokens/s ÷ greedy tokens/s on the same prompts, exact-
match rate and matched-prefix share vs our greedy; 95%
percentile-bootstrap CIs resample prompts (both MT-bench turns together), seeded.
``acceptance_by_position`` and ``main_table`` shape the records of
``actwave.decoding.evaluate``; ``read_selection_scores`` and ``tau_vs_scores`` join notebook
05's selection scores with measured τ.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

GREEDY = "greedy"


# ----------------------------------------------------------------------------- statistics
def bootstrap_ci(statistic: Callable[[np.ndarray], np.ndarray], n_units: int, n_bootstrap: int,
                 seed: int, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap over units: statistic(indices (B, n_units)) -> (B,) values."""
    rng = np.random.default_rng(seed)
    draws = statistic(rng.integers(0, n_units, size=(n_bootstrap, n_units)))
    tail = 100 * (1 - level) / 2
    low, high = np.nanpercentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def _per_prompt(records: pd.DataFrame) -> pd.DataFrame:
    """Sums per (benchmark, prompt, method): tokens, seconds, emitted, rounds, lookup rounds,
    exact turns."""
    frame = records.assign(
        emitted=records["n_tokens"] - 1,
        rounds=pd.to_numeric(records["target_forwards"], errors="coerce") - 1,
        lookup_rounds=pd.to_numeric(records.get("lookup_rounds", np.nan), errors="coerce"),
        exact=records["exact_match"].astype(float), turns=1)
    return frame.groupby(["benchmark", "prompt_id", "method"], sort=True)[
        ["n_tokens", "seconds", "emitted", "rounds", "lookup_rounds", "exact", "turns",
         "match_prefix"]
    ].sum(min_count=1).reset_index()


def _method_row(mine: pd.DataFrame, greedy: pd.DataFrame, n_bootstrap: int, seed: int) -> dict:
    """Point estimates and CIs for one method over aligned per-prompt rows."""
    tokens, seconds = mine["n_tokens"].to_numpy(float), mine["seconds"].to_numpy(float)
    base_tokens, base_seconds = greedy["n_tokens"].to_numpy(float), greedy["seconds"].to_numpy(float)
    emitted, rounds = mine["emitted"].to_numpy(float), mine["rounds"].to_numpy(float)

    def rate(idx):
        return tokens[idx].sum(-1) / seconds[idx].sum(-1)

    def speedup(idx):
        return rate(idx) / (base_tokens[idx].sum(-1) / base_seconds[idx].sum(-1))

    def tau(idx):
        return emitted[idx].sum(-1) / rounds[idx].sum(-1)

    everything = np.arange(len(mine))
    row = {"n_prompts": len(mine), "n_turns": int(mine["turns"].sum()),
           "exact_match_rate": float(mine["exact"].sum() / mine["turns"].sum()),
           # share of greedy's tokens reproduced before the first divergence (bf16 near-ties)
           "match_prefix_frac": float(mine["match_prefix"].sum() / base_tokens.sum())}
    has_rounds = bool(np.isfinite(rounds).all() and rounds.sum() > 0)
    # share of rounds that verified a copied chain (actwave.decoding.lookup), drafts only
    row["lookup_share"] = (float(mine["lookup_rounds"].sum() / rounds.sum())
                           if has_rounds and mine["lookup_rounds"].notna().all() else np.nan)
    for name, statistic in (("tokens_per_s", rate), ("speedup", speedup), ("tau", tau)):
        if name == "tau" and not has_rounds:
            row.update(tau=np.nan, tau_lo=np.nan, tau_hi=np.nan)
            continue
        low, high = bootstrap_ci(statistic, len(mine), n_bootstrap, seed)
        row.update({name: float(statistic(everything)), f"{name}_lo": low, f"{name}_hi": high})
    return row


def summarize(records: pd.DataFrame, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """One row per (benchmark incl. "all", label): τ, tokens/s, speedup (+ CIs), exactness;
    records keep the label under ``method``."""
    if records.empty:
        raise ValueError("no records to summarise (all prompts skipped or none run)")
    per_prompt = _per_prompt(records)
    pooled = per_prompt.assign(prompt_id=per_prompt["benchmark"] + "/" + per_prompt["prompt_id"],
                               benchmark="all")
    rows = []
    for benchmark, group in pd.concat([per_prompt, pooled]).groupby("benchmark", sort=True):
        by_method = {m: g.sort_values("prompt_id").reset_index(drop=True)
                     for m, g in group.groupby("method", sort=True)}
        greedy = by_method[GREEDY]
        for method, mine in by_method.items():
            if list(mine["prompt_id"]) != list(greedy["prompt_id"]):
                raise ValueError(f"method {method!r} has records for other prompts than greedy "
                                 f"on {benchmark!r}; cannot pair them for the speedup")
            rows.append({"benchmark": benchmark, "label": method,
                         **_method_row(mine, greedy, n_bootstrap, seed)})
    return pd.DataFrame(rows)


def acceptance_by_position(records: pd.DataFrame) -> pd.DataFrame:
    """Per (benchmark, label) and draft position i ≥ 1: the share of rounds accepting ≥ i
    draft tokens (``reach``) and P(accept ≥ i | accept ≥ i−1) (``conditional``)."""
    rows = []
    speculative = records[records["accept_counts"].notna()]
    for (benchmark, method), group in speculative.groupby(["benchmark", "method"], sort=True):
        width = max(len(h) for h in group["accept_counts"])
        histogram = np.zeros(width + 1)  # one empty bin: the first unreached position shows 0
        for counts in group["accept_counts"]:
            histogram[: len(counts)] += counts
        reach = histogram[::-1].cumsum()[::-1] / histogram.sum()  # reach[i] = P(accepted >= i)
        for position in range(1, width + 1):
            rows.append({"benchmark": benchmark, "label": method, "position": position,
                         "reach": float(reach[position]),
                         "conditional": float(reach[position] / reach[position - 1])
                         if reach[position - 1] > 0 else np.nan})
    return pd.DataFrame(rows, columns=["benchmark", "label", "position", "reach", "conditional"])


# ----------------------------------------------------------------------------- tables
def main_table(summary: pd.DataFrame, layer_ids: dict[str, tuple[int, ...]]) -> pd.DataFrame:
    """Wide table: one row per label, per benchmark τ and speedup with their 95% CIs.

    layer_ids: {label: layer ids} for draft rows (peer rows get an empty cell).
    """
    rows = []
    for label, group in summary.groupby("label", sort=True):
        row = {"label": label, "layer_ids": ",".join(map(str, layer_ids.get(label, ())))}
        for record in group.itertuples():
            for stat in ("tau", "speedup"):
                value, low, high = (getattr(record, s) for s in (stat, f"{stat}_lo", f"{stat}_hi"))
                row[f"{record.benchmark}_{stat}"] = value
                row[f"{record.benchmark}_{stat}_ci"] = "" if np.isnan(value) else f"[{low:.2f}, {high:.2f}]"
        rows.append(row)
    return pd.DataFrame(rows)


def read_selection_scores(path: Path | str) -> pd.DataFrame:
    """Notebook 05's ``05_selection.csv`` as long rows (model, token_set, layer_ids, score,
    value).

    Score columns are the numeric ones (percentile columns ``*_pct`` included);
    ``layer_ids`` cells are "a,b,c". The score of a set depends on the set, not on the
    method that picked it, so duplicates are dropped.
    """
    table = pd.read_csv(path)
    missing = [c for c in ("model", "token_set", "layer_ids") if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; found {list(table.columns)}")
    table = table.assign(layer_ids=table["layer_ids"].map(
        lambda s: tuple(int(x) for x in str(s).split(","))))
    scores = [c for c in table.select_dtypes("number").columns if c not in ("k", "seed")]
    keys = ["model", "token_set", "layer_ids"]
    long = table.melt(id_vars=keys, value_vars=scores, var_name="score", value_name="value")
    return long.dropna(subset=["value"]).drop_duplicates([*keys, "score"])


def tau_vs_scores(taus: pd.DataFrame, scores: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Join measured τ per draft with its selection scores; rank correlations per score.

    taus: columns model, label, layer_ids (tuple), tau. scores: ``read_selection_scores``.
    -> (joined rows, correlations: model ("all" = pooled), token_set, score, n, Spearman ρ
    and Kendall τ_b with p-values). Pooled rows rank τ within each model first.
    """
    from scipy.stats import kendalltau, spearmanr

    keys = ["model", "token_set", "score"]
    joined = taus.merge(scores, on=["model", "layer_ids"], how="inner")
    joined = joined.assign(tau_rank=joined.groupby(keys)["tau"].rank(pct=True),
                           value_rank=joined.groupby(keys)["value"].rank(pct=True))
    rows = []
    pooled = joined.assign(model="all", tau=joined["tau_rank"], value=joined["value_rank"])
    for (model, token_set, score), group in pd.concat([joined, pooled]).groupby(keys, sort=True):
        if len(group) < 3 or group["value"].nunique() < 2 or group["tau"].nunique() < 2:
            continue
        rho, rho_p = spearmanr(group["value"], group["tau"])
        kendall, kendall_p = kendalltau(group["value"], group["tau"])
        rows.append({"model": model, "token_set": token_set, "score": score, "n": len(group),
                     "spearman": rho, "spearman_p": rho_p, "kendall": kendall, "kendall_p": kendall_p})
    columns = ["model", "token_set", "score", "n", "spearman", "spearman_p", "kendall", "kendall_p"]
    return joined.drop(columns=["tau_rank", "value_rank"]), pd.DataFrame(rows, columns=columns)
