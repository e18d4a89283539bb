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
# # 04 · Aggregate entropy of concatenated layers
#
# An EAGLE-3 draft reads the concatenation [h_a; h_b; h_c] of k target layers. Its matrix
# entropy — each layer centred and scaled to unit trace first, so no layer wins by scale —
# measures how much the set carries jointly: high when the layers are individually rich
# *and* not redundant. For Rényi-2 it has an exact closed form in per-layer entropies and
# (biased) CKA, exp(−H₂(S)) = k⁻²[Σ_a P_a + 2Σ_{a<b} CKA_ab √(P_a P_b)], P_a = exp(−H₂(a)),
# so every pair and every triple of candidate layers (ℓ = 1..N; the embedding ℓ = 0 is the
# draft's own input) is scored exactly. Shannon H₁ needs a (k·d)² eigendecomposition per
# set, so it is computed for the `n_shannon` best triples by H₂ and the EAGLE-3 default,
# to check that the two orders agree.

# %% tags=["parameters"]
profile = "cpu"
models = "smollm2-135m,gemma3-270m"
seed = 0
device = "cpu"
filter_quantile = 0.5
max_tokens = 0  # 0 = use every kept token
matmul_dtype = "float32"  # per-chunk cross products (≈2× faster on CPU); sums stay float64
k = 3
n_shannon = 10  # top triples by H₂ whose Shannon aggregate entropy is computed

# %%
import itertools
import matplotlib.pyplot as plt
import pandas as pd

from actwave import index, plots
from actwave.capture import models as model_zoo
from actwave.notebook import notebook_setup
from actwave.profile import build
from actwave.stats import analysis, selection, selection_report

NOTEBOOK, model_names, results_dir, _ = notebook_setup("04_aggregate_entropy", profile, models)
stores = index.open_stores(results_dir, model_names, "analysis")  # notebook 01's stores
settings = build("analysis", globals())
keys = [(name, label) for name in model_names for label in settings]
stores, settings

# %% [markdown]
# ## Layer statistics (cached; covariance blocks are reloaded only for the Shannon step)

# %%
stats = {(name, label): analysis.compute_layer_stats(
             stores[name], settings[label], device=device).without_cov() for name, label in keys}
candidates = {key: selection.default_candidates(s.layers) for key, s in stats.items()}
num_layers = {name: max(stats[(name, "all tokens")].layers) for name in model_names}
reference_sets = {name: {"EAGLE-3 default": selection.eagle3_default(n),
                         "evenly spaced": selection.evenly_spaced(n, k),
                         "last k": selection.last_k(n, k),
                         "first k": selection.first_k(n, k)}
                  for name, n in num_layers.items()}
reference_sets

# %% [markdown]
# ## All pairs: Rényi-2 aggregate entropy (boxes: pairs inside the EAGLE-3 default)

# %%
pair_matrices = {key: selection_report.pairwise_scores(selection.renyi2_score(s),
                                                       candidates[key])
                 for key, s in stats.items()}
for name in model_names:
    fig, axes = plt.subplots(1, len(settings), figsize=(4.8 * len(settings), 4.2), squeeze=False)
    default_pairs = list(itertools.combinations(reference_sets[name]["EAGLE-3 default"], 2))
    for ax, label in zip(axes[0], settings):
        plots.plot_pair_heatmap(pair_matrices[(name, label)], layers=candidates[(name, label)],
                                marked_pairs=default_pairs, title=f"{name} · {label}",
                                cbar_label="H₂ of [h_i; h_j] (nats)", ax=ax)
    fig.tight_layout()
    saved = plots.save_figure(fig, f"04_pairs_{model_zoo.slug(name)}", NOTEBOOK)

# %% [markdown]
# ## All triples: distribution of H₂, reference sets marked (legend: percentile)

# %%
triples = {key: selection.exhaustive(selection.renyi2_score(s), candidates[key], k)
           for key, s in stats.items()}
for name in model_names:
    fig, axes = plt.subplots(1, len(settings), figsize=(6.2 * len(settings), 3.4), squeeze=False)
    for ax, label in zip(axes[0], settings):
        best, subsets, scores = triples[(name, label)]
        marks = {f"best {best}": selection.score_of(best, subsets, scores)}
        marks.update({f"{ref} {layers}": selection.score_of(layers, subsets, scores)
                      for ref, layers in reference_sets[name].items()})
        plots.plot_subset_distribution(scores, marks, title=f"{name} · {label}", ax=ax,
                                       xlabel=f"H₂ of {k} concatenated layers (nats), "
                                              f"{len(scores)} subsets")
    fig.tight_layout()
    saved = plots.save_figure(fig, f"04_triples_{model_zoo.slug(name)}", NOTEBOOK)

# %%
summary = pd.DataFrame([
    {"model": name, "token_set": label, "n_subsets": len(scores), "best": best,
     "best_renyi2": float(scores.max()), "median_renyi2": float(scores.median()),
     "worst_renyi2": float(scores.min()),
     **{f"{ref}_renyi2": selection.score_of(layers, subsets, scores)
        for ref, layers in reference_sets[name].items()},
     **{f"{ref}_pct": selection.percentile(selection.score_of(layers, subsets, scores), scores)
        for ref, layers in reference_sets[name].items()}}
    for (name, label), (best, subsets, scores) in triples.items()])
plots.save_table(summary, "04_triples_summary", NOTEBOOK, results_dir,
                 sort_by=["model", "token_set"])
summary.T

# %% [markdown]
# ## Shannon H₁ of the top triples by H₂ (plus the default): do the two orders agree?
# One eigendecomposition of a (k·d)² covariance per set, from the stored blocks.

# %%
top_sets = {key: selection_report.top_subsets(subsets, scores, n_shannon,
                                              include=[reference_sets[key[0]]["EAGLE-3 default"]])
            for key, (_, subsets, scores) in triples.items()}
shannon = {(name, label): selection.aggregate_score(analysis.compute_layer_stats(
               stores[name], settings[label], device=device), alpha=1.0)(top_sets[(name, label)])
           for name, label in keys}
top_table = pd.DataFrame([
    {"model": name, "token_set": label, "rank_renyi2": rank + 1, "layer_ids": tuple(row),
     "renyi2": selection.score_of(row, *triples[(name, label)][1:]),
     "shannon": float(value),
     "is_default": tuple(row) == reference_sets[name]["EAGLE-3 default"]}
    for (name, label), sets in top_sets.items()
    for rank, (row, value) in enumerate(zip(sets.tolist(), shannon[(name, label)]))])
plots.save_table(top_table, "04_shannon_top", NOTEBOOK, results_dir,
                 sort_by=["model", "token_set", "rank_renyi2"])
agreement = top_table.groupby(["model", "token_set"])[["renyi2", "shannon"]].corr(
    method="spearman").xs("renyi2", level=2)["shannon"].rename("spearman_renyi2_shannon")
agreement
