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
# # 03 · Geometry across depth: linear CKA between layers
#
# L×L linear CKA (Kornblith et al. 2019) between the hidden states of every pair of
# layers ℓ = 0..N, biased and debiased (Székely–Rizzo U-statistic). Biased CKA has a
# positive floor at small token counts, which filtering makes smaller still, so the
# debiased matrix is the one used for selection. *Compartments* — contiguous blocks of
# mutually similar layers, found by maximising modularity over contiguous segmentations
# (`actwave.stats.metrics.compartments`) — are drawn as boxes; the EAGLE-3 default layers are
# marked in green. Special tokens are excluded unless the token set says otherwise.

# %% tags=["parameters"]
profile = "cpu"
models = "smollm2-135m,gemma3-270m"
seed = 0
device = "cpu"
filter_quantile = 0.5
max_tokens = 0  # 0 = use every kept token
matmul_dtype = "float32"  # per-chunk cross products (≈2× faster on CPU); sums stay float64
compartment_resolution = 1.0

# %%
import matplotlib.pyplot as plt
import pandas as pd

from actwave import index, plots
from actwave.capture import models as model_zoo
from actwave.notebook import notebook_setup
from actwave.profile import build
from actwave.stats import analysis, selection, selection_report

NOTEBOOK, model_names, results_dir, _ = notebook_setup("03_cka_geometry", profile, models)
stores = index.open_stores(results_dir, model_names, "analysis")  # notebook 01's stores
settings = build("analysis", globals(), with_special=True)
cka_kinds = {"debiased": True, "biased": False}
stores, settings

# %% [markdown]
# ## Layer statistics (cached by notebook 02's calls; covariance blocks dropped)

# %%
stats = analysis.per_layer_stats(
    stores, settings, device)
default_layers = {name: selection.eagle3_default(max(stats[(name, "all tokens")].layers))
                  for name in model_names}
blocks = {(name, label, kind): selection.compartment_layers(
              s, debiased=debiased, resolution=compartment_resolution)
          for (name, label), s in stats.items() for kind, debiased in cka_kinds.items()}

# %% [markdown]
# ## CKA heatmaps: rows = token sets, columns = debiased / biased

# %%
for name in model_names:
    fig, axes = plt.subplots(len(settings), len(cka_kinds), squeeze=False,
                             figsize=(4.6 * len(cka_kinds), 4.0 * len(settings)))
    for row, label in enumerate(settings):
        s = stats[(name, label)]
        for col, (kind, debiased) in enumerate(cka_kinds.items()):
            plots.plot_cka_heatmap(s.cka if debiased else s.cka_biased, layers=s.layers,
                                   compartments=blocks[(name, label, kind)],
                                   marked_layers=default_layers[name],
                                   title=f"{label} · {kind} (n={s.n_tokens})",
                                   ax=axes[row][col])
    fig.suptitle(f"{name}: linear CKA between layers")
    fig.tight_layout()
    saved = plots.save_figure(fig, f"03_cka_{model_zoo.slug(name)}", NOTEBOOK)

# %% [markdown]
# ## Compartments, and the biased-CKA floor
# `floor` = mean off-diagonal biased − debiased CKA: the positive bias of the plug-in
# estimator at this token count.

# %%
compartment_rows = pd.DataFrame([
    {"model": name, "token_set": label, "cka": kind, "block": i, "first": first, "last": last,
     "eagle3_default_layers": sum(first <= v <= last for v in default_layers[name])}
    for (name, label, kind), found in blocks.items() for i, (first, last) in enumerate(found)])
plots.save_table(compartment_rows, "03_compartments", NOTEBOOK, results_dir,
                 sort_by=["model", "token_set", "cka", "block"])
floor = pd.DataFrame([
    {"model": name, "token_set": label, "n_tokens": s.n_tokens,
     "mean_offdiag_debiased": float(selection_report.off_diagonal_mean(s.cka)),
     "mean_offdiag_biased": float(selection_report.off_diagonal_mean(s.cka_biased))}
    for (name, label), s in stats.items()])
floor["floor"] = floor["mean_offdiag_biased"] - floor["mean_offdiag_debiased"]
plots.save_table(floor, "03_cka_floor", NOTEBOOK, results_dir, sort_by=["model", "token_set"])
print(compartment_rows[compartment_rows["cka"] == "debiased"].to_string(index=False))
floor
