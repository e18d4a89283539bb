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
# Every method of `actwave.stats.selection` picks k layers from the candidates ℓ = 1..N, per
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
filter_quantile = 0.5
max_tokens = 0  # 0 = use every kept token
matmul_dtype = "float32"  # per-chunk cross products (≈2× faster on CPU); sums stay float64
k = 3
greedy_alpha = 1.0  # Rényi order of the greedy aggregate-entropy method (1 = Shannon)
mrmr_lambda = 1.0
dpp_theta = 1.0
combined_method = "renyi2_exhaustive"  # entropy+CKA method whose sets go to notebook 06
competitive_percentile = 90.0

# %%
import pandas as pd

from actwave import index, plots
from actwave.config import package_versions
from actwave.notebook import notebook_setup
from actwave.profile import build
from actwave.stats import analysis, selection_report

NOTEBOOK, model_names, results_dir, _ = notebook_setup("05_layer_selection", profile, models)
stores = index.open_stores(results_dir, model_names, "analysis")  # notebook 01's stores
settings = build("analysis", globals())
unfiltered, filtered = settings  # "all tokens", "top X% entropy"
config = build("selection", globals())
methods = config.methods()  # label (= method name): (method, options)
keys = [(name, label) for name in model_names for label in settings]
stores, settings

# %% [markdown]
# ## Every method's set, its scores and percentiles
# Full statistics (with covariance blocks, for the greedy Shannon method) are loaded one
# model and token set at a time.

# %%
records = {(name, label): selection_report.compare_methods(analysis.compute_layer_stats(
               stores[name], settings[label], device=device), methods, k=config.k)
           for name, label in keys}
table = pd.DataFrame([{"model": name, "token_set": label, **record}
                      for (name, label), rows in records.items() for record in rows])
table = table.rename(columns={"layers": "layer_ids"})  # compare_methods: "layers"
plots.save_table(table, "05_selection", NOTEBOOK, results_dir,
                 sort_by=["model", "token_set", "label"])
table[["model", "token_set", "label", "layer_ids", "renyi2", "renyi2_pct", "logdet_pct"]]

# %%
for objective in ("renyi2", "logdet"):
    fig = plots.plot_method_scores(
        table, method="label", value=f"{objective}_pct", hue="token_set", col="model",
        xlabel=f"percentile of {objective} among all C(N, {config.k}) sets",
        title=f"where each method's set falls ({objective})")
    saved = plots.save_figure(fig, f"05_selection_{objective}", NOTEBOOK)

# %% [markdown]
# ## Is the EAGLE-3 default competitive, and why?
# From the statistics alone: the default's H₂ percentile, the entropy rank of its layers
# among the candidates, its redundancy (mean pairwise debiased CKA) and how many CKA
# compartments it spans, next to the set of `combined_method` (by default the best H₂ set).

# %%
stats = {(name, label): analysis.compute_layer_stats(
             stores[name], settings[label], device=device).without_cov() for name, label in keys}
explanations = [f"**{name} · {label}**: " + selection_report.explain_default(
                    stats[(name, label)], rows, config)
                for (name, label), rows in records.items()]
print("\n\n".join(explanations))

# %% [markdown]
# ## Candidate layer sets for notebook 06 (one draft is trained per set)
# `selection_report.DRAFT_SOURCES` says which method and token set feeds each draft; the
# entropy+CKA drafts take `combined_method`'s sets.

# %%
picks = {key: {row["label"]: row["layers"] for row in rows} for key, rows in records.items()}
candidate_sets = {name: config.candidate_sets(picks[(name, unfiltered)], picks[(name, filtered)])
                  for name in model_names}
plots.save_json(candidate_sets, index.CANDIDATE_SETS, NOTEBOOK, results_dir)
plots.save_json({"selection": config, "analysis": settings,
                 "captures": {name: s.config_hash for name, s in stores.items()},
                 "versions": package_versions()}, "05_selection_config", NOTEBOOK, results_dir)
candidate_sets
