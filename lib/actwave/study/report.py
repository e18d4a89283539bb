"""Tables and figures of the layer-set study, from its records (notebook 10).

Table builders take the records (``actwave.study.runs.load_records``) and the sets table that
notebook 08 wrote (selection proxies per set) and return DataFrames; the statistics are
``actwave.study.stats``. Plot helpers return a Figure and never save.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from actwave.study import stats as study_stats
from actwave.study.runs import PROXIES, SETTINGS

REFERENCE = "eagle3_default"


def main_records(records: list[dict]) -> list[dict]:
    """Records of the equal-budget drafts (the learning-curve run excluded)."""
    return [r for r in records if r.get("steps_factor", 1) == 1]


def summary_table(records: list[dict], n_bootstrap: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per set: τ̂ mean ± SD over seeds and the paired difference to the default with CIs."""
    groups = study_stats.by_label(main_records(records))
    if REFERENCE not in groups:
        raise ValueError(f"no record of the reference set {REFERENCE!r}; train it first")
    rows = []
    for row in study_stats.set_summary(groups):
        diff = ({} if row["label"] == REFERENCE else study_stats.paired_difference(
            groups[row["label"]], groups[REFERENCE], n_bootstrap, seed))
        rows.append({**row, **{f"vs_default_{k}": v for k, v in diff.items()
                               if k not in ("n_seeds", "n_sequences")}})
    table = pd.DataFrame(rows).sort_values("tau_hat", ascending=False, kind="stable")
    return table.reset_index(drop=True)


def proxy_correlations(summary: pd.DataFrame, sets: pd.DataFrame, k: int = 3,
                       n_permutations: int = 10000, seed: int = 0) -> pd.DataFrame:
    """Spearman / Kendall of every proxy (both token sets) with τ̂ over the trained k-sets."""
    joined = summary[summary["k"] == k].merge(sets, on="label", suffixes=("", "_set"))
    rows = []
    for token_set in SETTINGS:
        for proxy in PROXIES:
            column = f"{proxy}_{token_set}"
            stats = study_stats.rank_correlation(joined[column], joined["tau_hat"],
                                                 n_permutations, seed)
            rows.append({"proxy": proxy, "token_set": token_set, **stats})
    return pd.DataFrame(rows)


# Where in depth a set sits, in layer indices ℓ (the layer convention of docs/METHODS.md §1).
DEPTH_FEATURES = {"deepest": max, "shallowest": min,
                  "mean_layer": lambda layers: sum(layers) / len(layers),
                  "spread": lambda layers: max(layers) - min(layers)}


def layer_ids_of(cell) -> list[int]:
    """A layer_ids cell -> [2, 15, 27]: a sequence of ints (in memory) or "2,15,27" (CSV)."""
    if isinstance(cell, str):
        return [int(part) for part in cell.split(",")]
    return [int(layer) for layer in cell]


def depth_correlations(summary: pd.DataFrame, k: int = 3, n_permutations: int = 10000,
                       seed: int = 0) -> pd.DataFrame:
    """Exploratory, chosen after seeing the data: Spearman / Kendall of where a trained
    k-set sits in depth (deepest, shallowest and mean layer, spread) with τ̂."""
    trained = summary[summary["k"] == k]
    layer_sets = [layer_ids_of(text) for text in trained["layer_ids"]]
    rows = []
    for feature, fn in DEPTH_FEATURES.items():
        stats = study_stats.rank_correlation([fn(layers) for layers in layer_sets],
                                             trained["tau_hat"], n_permutations, seed)
        rows.append({"feature": feature, **stats})
    return pd.DataFrame(rows)


def noise_floor(summary: pd.DataFrame) -> float:
    """Pooled SD of τ̂ over seeds among the multi-seed sets (NaN if none)."""
    multi = summary[summary["n_seeds"] > 1]
    if multi.empty:
        return math.nan
    return float(np.sqrt((multi["tau_hat_sd"] ** 2 * (multi["n_seeds"] - 1)).sum()
                         / (multi["n_seeds"] - 1).sum()))


def curve_table(records: list[dict]) -> pd.DataFrame:
    """The learning-curve run: offline τ̂ and acceptance per checkpoint vs training tokens."""
    rows = [{"label": r["label"], "seed": r["seed"], **point}
            for r in records if r.get("steps_factor", 1) > 1 for point in r["curve"]]
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- figures
def plot_set_taus(summary: pd.DataFrame, title: str = "") -> Figure:
    """τ̂ per set (mean ± SD over seeds, seeds as dots), best first; the default's line."""
    fig, ax = plt.subplots(figsize=(6.0, 0.22 * len(summary) + 1.2))
    colours = {"default": "C3", "selected": "C0", "baseline": "C2", "random": "C7",
               "extra_k": "C4"}
    y = np.arange(len(summary))[::-1]
    for yi, (_, row) in zip(y, summary.iterrows()):
        sd = row["tau_hat_sd"] if np.isfinite(row["tau_hat_sd"]) else 0.0
        ax.errorbar(row["tau_hat"], yi, xerr=sd, fmt="o", color=colours.get(row["kind"], "k"),
                    ms=4, capsize=2)
    reference = summary.loc[summary["label"] == REFERENCE, "tau_hat"]
    if len(reference):
        ax.axvline(float(reference.iloc[0]), color="C3", lw=0.8, ls="--")
    ax.set_yticks(y, [f"{l} {tuple(ids)}" for l, ids in zip(summary["label"],
                                                             summary["layer_ids"])], fontsize=6)
    ax.set_xlabel("offline τ̂ (chain, held-out positions)")
    ax.set_title(title)
    return fig


def plot_proxy_vs_tau(summary: pd.DataFrame, sets: pd.DataFrame, k: int = 3,
                      title: str = "") -> Figure:
    """One panel per proxy (all tokens): score vs τ̂ over the trained k-sets."""
    joined = summary[summary["k"] == k].merge(sets, on="label", suffixes=("", "_set"))
    fig, axes = plt.subplots(1, len(PROXIES), figsize=(2.4 * len(PROXIES), 2.4), sharey=True)
    for ax, proxy in zip(axes, PROXIES):
        for kind, part in joined.groupby("kind"):
            ax.scatter(part[f"{proxy}_all"], part["tau_hat"], s=12, label=kind)
        ax.set_xlabel(proxy)
    axes[0].set_ylabel("offline τ̂")
    axes[-1].legend(fontsize=6)
    fig.suptitle(title)
    return fig


def plot_curve(curve: pd.DataFrame, budget_tokens: float | None = None,
               title: str = "") -> Figure:
    """τ̂ and step-0 acceptance vs training tokens; the study's budget as a line."""
    fig, ax = plt.subplots(figsize=(4.5, 3.0))
    ax.plot(curve["tokens"], curve["tau_hat"], "o-", label="τ̂ (chain)")
    ax.plot(curve["tokens"], curve["tau_hat_topk"], "s--", label="τ̂ (top-k tree)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("offline τ̂")
    if budget_tokens:
        ax.axvline(budget_tokens, color="k", lw=0.8, ls=":", label="study budget")
    ax.legend(fontsize=7)
    ax.set_title(title)
    return fig


# ----------------------------------------------------------------------------- decoding
def per_prompt_decoding(records: pd.DataFrame) -> pd.DataFrame:
    """Decoding records -> per (benchmark, prompt, method): emitted tokens, rounds, tokens,
    seconds (summed over turns); records keep the label under ``method``."""
    frame = records.assign(emitted=records["n_tokens"] - 1,
                           rounds=pd.to_numeric(records["target_forwards"], errors="coerce") - 1)
    return frame.groupby(["benchmark", "prompt_id", "method"], sort=True)[
        ["emitted", "rounds", "n_tokens", "seconds"]].sum().reset_index()


def paired_decoding(records: pd.DataFrame, label: str, reference: str = REFERENCE,
                    n_bootstrap: int = 2000, seed: int = 0) -> dict:
    """τ and speedup of ``label`` minus ``reference`` on the same prompts (all benchmarks),
    with a paired bootstrap over prompts. Speedup = tokens/s ÷ greedy tokens/s."""
    per = per_prompt_decoding(records)
    wide = per.pivot_table(index=["benchmark", "prompt_id"], columns="method",
                           values=["emitted", "rounds", "n_tokens", "seconds"])
    def stat(idx):
        def tau(m):
            return wide["emitted"][m].to_numpy()[idx].sum(-1) / wide["rounds"][m].to_numpy()[idx].sum(-1)
        def rate(m):
            return wide["n_tokens"][m].to_numpy()[idx].sum(-1) / wide["seconds"][m].to_numpy()[idx].sum(-1)
        return tau(label) - tau(reference), (rate(label) - rate(reference)) / rate("greedy")
    n = len(wide)
    rng = np.random.default_rng(seed)
    boot = rng.integers(0, n, size=(n_bootstrap, n))
    tau_diff, speed_diff = stat(np.arange(n))
    tau_boot, speed_boot = stat(boot)
    return {"label": label, "reference": reference, "n_prompts": n,
            "tau_diff": float(tau_diff), "tau_diff_lo": float(np.quantile(tau_boot, 0.025)),
            "tau_diff_hi": float(np.quantile(tau_boot, 0.975)),
            "speedup_diff": float(speed_diff),
            "speedup_diff_lo": float(np.quantile(speed_boot, 0.025)),
            "speedup_diff_hi": float(np.quantile(speed_boot, 0.975))}


def offline_vs_decoding(record: dict, records: pd.DataFrame, label: str) -> dict:
    """One draft: offline τ̂, offline decoding-walk τ, and decoding τ (ShareGPT eval prompts
    and all benchmarks) from the decoding records."""
    per = per_prompt_decoding(records)
    mine = per[per["method"] == label]
    sharegpt = mine[mine["benchmark"] == "sharegpt"]
    rows = record["offline"]["per_sequence"]
    walked = [r for r in rows if r["walk_rounds"]]
    walk = (sum(r["walk_tau"] * r["walk_rounds"] for r in walked)
            / max(1, sum(r["walk_rounds"] for r in walked)))
    return {"label": label, "layer_ids": tuple(record["layer_ids"]),
            "tau_hat": record["offline"]["tau_hat"], "walk_tau": walk,
            "decoding_tau_sharegpt": float(sharegpt["emitted"].sum() / sharegpt["rounds"].sum())
            if len(sharegpt) else math.nan,
            "decoding_tau_all": float(mine["emitted"].sum() / mine["rounds"].sum())}


def plot_offline_vs_decoding(agreement: pd.DataFrame) -> Figure:
    """Decoding τ (held-out ShareGPT, all benchmarks) against offline τ̂ and walk τ."""
    fig, ax = plt.subplots(figsize=(4.0, 3.6))
    for column, marker in (("decoding_tau_sharegpt", "o"), ("decoding_tau_all", "s")):
        ax.scatter(agreement["tau_hat"], agreement[column], marker=marker,
                   label=f"{column.removeprefix('decoding_')} vs offline τ̂")
    ax.scatter(agreement["walk_tau"], agreement["decoding_tau_sharegpt"], marker="x",
               label="tau_sharegpt vs offline walk τ")
    values = agreement[["tau_hat", "walk_tau", "decoding_tau_sharegpt", "decoding_tau_all"]]
    low, high = float(np.nanmin(values.to_numpy())), float(np.nanmax(values.to_numpy()))
    ax.plot([low, high], [low, high], color="k", lw=0.7, ls=":")
    ax.set_xlabel("offline")
    ax.set_ylabel("chain speculative decoding τ")
    ax.legend(fontsize=6)
    return fig


def budget_tokens(records: list[dict]) -> float:
    """Training tokens of one equal-budget draft (the default's, seed order first)."""
    main = [r for r in main_records(records) if r["label"] == REFERENCE]
    return float(main[0]["history"][-1]["tokens"]) if main and main[0]["history"] else math.nan


# ----------------------------------------------------------------------------- long runs
def long_tables(records: list[dict], n_bootstrap: int = 2000, n_permutations: int = 10000,
                seed: int = 0) -> dict[str, pd.DataFrame]:
    """The long runs' tables of one model (``actwave.study.longrun`` records):

    - ``sets``: per budget × set, τ̂ (mean, seed SD, min, max) and the paired Δ vs the
      default with its seed × sequence CI and Holm-adjusted p (the primary comparison unadjusted);
    - ``rank_stability``: rankings at successive budgets, and each budget vs the largest
      (``predicts``: the budget's ranking predicts the largest budget's);
    - ``costs``: per budget, the seconds one draft took (``long_costs``);
    - ``steps``: per-step agreement vs chained acceptance (``step_table``).
    """
    curves = pd.DataFrame(study_stats.budget_curves(records))
    versus = pd.DataFrame(study_stats.budget_comparisons(records, n_bootstrap=n_bootstrap, seed=seed))
    sets = curves if versus.empty else curves.merge(
        versus.drop(columns=[c for c in ("n_seeds",) if c in versus]),
        on=["budget", "label"], how="left")
    seed_zero = [r for r in records if int(r["seed"]) == 0]
    stability = pd.concat([rank_table(records, n_permutations, seed).assign(seeds="all"),
                           rank_table(seed_zero, n_permutations, seed).assign(seeds="0")],
                          ignore_index=True)
    return {"sets": sets, "rank_stability": stability, "costs": long_costs(records),
            "steps": step_table(records)}


def long_proxy_correlations(curves: pd.DataFrame, proxies: pd.DataFrame,
                            n_permutations: int = 10000, seed: int = 0) -> pd.DataFrame:
    """What the selection scores predict as drafts learn: per budget, Spearman / Kendall
    (permutation p) of every proxy on both token sets with the sets' seed-mean τ̂.

    curves: ``long_tables(...)["sets"]`` (budget, label, tau_hat); proxies: one row per label
    with ``<proxy>_<token_set>`` columns (``runs.set_proxies`` of each set's layers).
    """
    rows = []
    for budget, part in curves.groupby("budget", sort=True):
        joined = part.merge(proxies, on="label")
        for token_set in SETTINGS:
            for proxy in PROXIES:
                stats = study_stats.rank_correlation(joined[f"{proxy}_{token_set}"],
                                                     joined["tau_hat"], n_permutations, seed)
                rows.append({"budget": budget, "proxy": proxy, "token_set": token_set, **stats})
    return pd.DataFrame(rows)


def rank_table(records: list[dict], n_permutations: int, seed: int) -> pd.DataFrame:
    """Rank stability of ``records`` between successive budgets and each budget vs the
    largest (``study_stats``: budgets missing a (set, seed) are left out). Run on seed 0
    alone too: seed 0 reaches the largest budget for every set first, so its rows speak
    while seeds 1–2 are under way (one seed: no seed noise averaged out)."""
    successive = pd.DataFrame(study_stats.rank_stability(records, n_permutations, seed))
    largest = pd.DataFrame(study_stats.rank_vs_largest(records, n_permutations, seed))
    table = pd.concat([successive.rename(columns={"next_budget": "versus"}).assign(
        comparison="next budget"), largest.assign(comparison="largest budget")],
        ignore_index=True)
    return table.rename(columns={"budget": "train_steps"})


def step_table(records: list[dict]) -> pd.DataFrame:
    """Where chained acceptance goes, per budget × set × draft step i (seed means):

    ``agreement`` a_i, the TTT step's top-1 agreement with the target on the target's text
    (whatever the draft predicted before); ``chained`` c_i, steps 0…i all right (what chain
    decoding accepts); ``conditional`` c_i / c_(i−1), step i right given a right prefix;
    ``independent`` a_0·…·a_i, the chain if the steps' errors were independent.
    """
    rows = []
    for record in records:
        offline = record["offline"]
        chained = [float(c) for c in offline["step_acceptance"]]
        agreement = [float(a) for a in offline["step_agreement"]]
        for step, (agree, chain) in enumerate(zip(agreement, chained)):
            previous = chained[step - 1] if step else 1.0
            rows.append({"budget": record["budget"], "label": record["label"], "step": step,
                         "agreement": agree, "chained": chain,
                         "conditional": chain / previous if previous > 0 else math.nan,
                         "independent": float(np.prod(agreement[:step + 1]))})
    columns = ["budget", "label", "step", "agreement", "chained", "conditional", "independent"]
    frame = pd.DataFrame(rows, columns=columns)
    return frame.groupby(columns[:3], as_index=False).mean()


# A job with its 2 threads alone on 2 cores keeps the 1-minute load average near 2; above
# this, something else shared the cores and its seconds overstate the cost.
IDLE_LOAD = 2.5


def long_costs(records: list[dict]) -> pd.DataFrame:
    """What one draft of each budget cost on the device (and CPU model) that made it:
    training seconds to reach the budget (the trunk up to the branch point + the decay
    branch, as one run without the other budgets would cost), per step, and the scoring
    seconds; medians over every job and over the idle ones (load average ≤ ``IDLE_LOAD`` at
    start and end). Records from before the CPU was recorded say "unrecorded"."""
    rows = []
    for record in records:
        training, machine = record.get("training", {}), record.get("machine", {})
        load = max(machine.get("load_average", math.inf), machine.get("load_average_end", math.inf))
        rows.append({"budget": record["budget"], "device": machine.get("device", "?"),
                     "cpu": machine.get("cpu", "unrecorded"),
                     "seconds": training.get("seconds", math.nan),
                     "score_seconds": training.get("score_seconds", math.nan),
                     "idle": load <= IDLE_LOAD})
    frame = pd.DataFrame(rows, columns=["budget", "device", "cpu", "seconds", "score_seconds",
                                        "idle"])
    idle_seconds = frame["seconds"].where(frame["idle"])
    costs = frame.assign(idle_seconds=idle_seconds).groupby(["budget", "device", "cpu"]).agg(
        drafts=("seconds", "size"), idle_drafts=("idle", "sum"),
        train_seconds=("seconds", "median"), train_seconds_idle=("idle_seconds", "median"),
        score_seconds=("score_seconds", "median")).reset_index()
    return costs.assign(seconds_per_step=costs["train_seconds"] / costs["budget"])


def plot_tau_vs_budget(curves: pd.DataFrame, title: str = "") -> Figure:
    """τ̂ against training budget (log scale) per set: the seed mean as a line, the range
    over seeds as a band."""
    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    for label, rows in curves.sort_values("budget").groupby("label", sort=True):
        line, = ax.plot(rows["budget"], rows["tau_hat"], marker="o", ms=3, lw=1.2, label=label)
        ax.fill_between(rows["budget"], rows["tau_hat_min"], rows["tau_hat_max"],
                        color=line.get_color(), alpha=0.18, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training steps (decayed branch of one WSD run)")
    ax.set_ylabel("offline τ̂ (held-out)")
    ax.set_title(title)
    ax.legend(fontsize=6, ncol=2)
    return fig
