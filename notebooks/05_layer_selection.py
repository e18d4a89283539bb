# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Layer selection: which k layers each algorithm picks, and how good they are
#
# Every method of `actwave.selection` picks k layers from the candidates ℓ = 1..N, per
# model and token set (all tokens / top-entropy tokens). Each set is then scored under four
# objectives over *all* C(N, k) subsets and placed as a percentile (share of subsets that
# score at most as well):
#
# * `renyi2` — H₂ of the concatenated, unit-trace layers (entropy and CKA redundancy in one
#   tuning-free number, exact closed form);
# * `logdet` — log det of the DPP kernel diag(q)·CKA·diag(q), q = exp(θ·H₁);
# * `entropy_sum` — Σ H₁ (informativeness only);
# * `dispersion` — min pairwise 1 − CKA (diversity only).
#
# The last cell writes the candidate layer sets that notebook 06 trains drafts on.

# %% tags=["parameters"]
profile = "cpu"
models = "smollm2-135m,gemma3-270m"
seed = 0
device = "cpu"
capture_dtype = "float32"  # capture keys as in notebook 01 (they locate its store)
analysis_sequences = 64
max_seq_len = 512
capture_batch_size = 4
filter_quantile = 0.5
max_tokens = 0  # 0 = use every kept token
stats_matmul_dtype = "float64"  # "float32": ≈2× faster streaming pass on CPU
k = 3
greedy_alpha = 1.0  # Rényi order of the greedy aggregate-entropy method (1 = Shannon)
mrmr_lambda = 1.0
dpp_theta = 1.0
combined_method = "renyi2_exhaustive"  # entropy+CKA method whose sets go to notebook 06
competitive_percentile = 90.0

# %%
import logging
from statistics import mean

import pandas as pd

from actwave import analysis, plots, selection_report, store
from actwave.config import package_versions, repo_root

logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
logging.getLogger("actwave").setLevel(logging.INFO)
NOTEBOOK = "05_layer_selection"
model_names = [name.strip() for name in models.split(",") if name.strip()]
captures = store.analysis_captures(
    model_names, n_sequences=analysis_sequences, max_seq_len=max_seq_len,
    batch_size=capture_batch_size, dtype=capture_dtype, seed=seed)
settings = analysis.token_settings(filter_quantile, max_tokens=max_tokens or None, seed=seed,
                                   matmul_dtype=stats_matmul_dtype)
unfiltered, filtered = settings  # "all tokens", "top X% entropy"
config = selection_report.SelectionConfig(
    k=k, greedy_alpha=greedy_alpha, mrmr_lambda=mrmr_lambda, dpp_theta=dpp_theta,
    combined_method=combined_method, competitive_percentile=competitive_percentile, seed=seed)
methods = config.methods()  # label (= method name): (method, options)
keys = [(name, label) for name in model_names for label in settings]
results_dir = repo_root() / "results" / profile
plots.setup_style()
captures, settings

# %% [markdown]
# ## Every method's set, its scores and percentiles
# Full statistics (with covariance blocks, for the greedy Shannon method) are loaded one
# model and token set at a time.

# %%
stores = {name: store.open_store(config) for name, config in captures.items()}
records = {(name, label): selection_report.compare_methods(analysis.compute_layer_stats(
               stores[name], settings[label], device=device), methods, k=config.k)
           for name, label in keys}
table = pd.DataFrame([{"model": name, "setting": label, **record}
                      for (name, label), rows in records.items() for record in rows])
plots.save_table(table, "05_selection", NOTEBOOK, results_dir,
                 sort_by=["model", "setting", "label"])
table[["model", "setting", "label", "layers", "renyi2", "renyi2_pct", "logdet_pct"]]

# %%
for objective in ("renyi2", "logdet"):
    fig = plots.plot_method_scores(
        table, method="label", value=f"{objective}_pct", hue="setting", col="model",
        xlabel=f"percentile of {objective} among all C(N, {config.k}) sets",
        title=f"where each method's set falls ({objective})")
    saved = plots.save_figure(fig, f"05_selection_{objective}", NOTEBOOK)

# %% [markdown]
# ## Is the EAGLE-3 default competitive, and why?
# From the statistics alone: the default's H₂ percentile, the entropy rank of its layers
# among the candidates, its redundancy (mean pairwise debiased CKA) and how many CKA
# compartments it spans, next to the best H₂ set.

# %%
stats = {(name, label): analysis.compute_layer_stats(
             stores[name], settings[label], device=device).without_cov() for name, label in keys}
best_label = "renyi2_exhaustive"
explanations = []
for (name, label), rows in records.items():
    by_label = {row["label"]: row for row in rows}
    set_stats = stats[(name, label)]
    default = selection_report.set_profile(set_stats, by_label["eagle3_default"]["layers"])
    best = selection_report.set_profile(set_stats, by_label[best_label]["layers"])
    percentile = by_label["eagle3_default"]["renyi2_pct"]
    verdict = "competitive" if percentile >= config.competitive_percentile else "not competitive"
    less_informative = mean(default["entropy_ranks"]) > mean(best["entropy_ranks"])
    more_redundant = default["mean_cka"] > best["mean_cka"]
    explanations.append(
        f"**{name} · {label}**: the default {default['layers']} is **{verdict}** — H₂ "
        f"percentile {percentile:.1f} (best set {best['layers']}). Entropy ranks of its "
        f"layers {default['entropy_ranks']} vs {best['entropy_ranks']} for the best set; mean "
        f"pairwise CKA {default['mean_cka']:.2f} vs {best['mean_cka']:.2f}; it spans "
        f"{default['compartments_hit']} of {default['n_compartments']} compartments "
        f"(best: {best['compartments_hit']}). Relative to the best set its layers are "
        f"{'less' if less_informative else 'no less'} informative and "
        f"{'more' if more_redundant else 'no more'} redundant.")
print("\n\n".join(explanations))

# %% [markdown]
# ## Candidate layer sets for notebook 06 (one draft is trained per set)

# %%
picks = {key: {row["label"]: list(row["layers"]) for row in rows} for key, rows in records.items()}
candidate_sets = {name: {
    "eagle3_default": picks[(name, unfiltered)]["eagle3_default"],
    "entropy_cka_filtered": picks[(name, filtered)][config.combined_method],
    "entropy_cka_unfiltered": picks[(name, unfiltered)][config.combined_method],
    "entropy_only": picks[(name, filtered)]["entropy_topk"],
    "cka_only": picks[(name, filtered)]["cka_farthest"],
    "control_adjacent_early": picks[(name, unfiltered)]["first_k"],
} for name in model_names}
plots.save_json(candidate_sets, "05_candidate_sets", NOTEBOOK, results_dir)
plots.save_json({"selection": config, "analysis": settings,
                 "captures": {name: s.config_hash for name, s in stores.items()},
                 "versions": package_versions()}, "05_selection_config", NOTEBOOK, results_dir)
candidate_sets
