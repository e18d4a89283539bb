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
# # 02 · Matrix entropy across depth (the "activation wave")
#
# Per-layer matrix entropy of the hidden states notebook 01 captured, for every layer
# ℓ = 0..N (ℓ = blocks applied; ℓ = N is the last block's output before the final norm).
# Entropy in nats of the token-centred covariance spectrum: Shannon H₁ and Rényi-2 H₂.
# Token sets compared:
#
# * **all tokens** — every token except special/template tokens;
# * **top-entropy tokens** — tokens whose predictive entropy (from the target's own logits)
#   is above the `filter_quantile` quantile: the hard tokens that decide acceptance;
# * **all + special** — special tokens kept, to show once how a few massive-activation
#   tokens (BOS, template markers) distort the statistics.
#
# The EAGLE-3 default layers (2, N//2, N−3) are marked.

# %% tags=["parameters"]
profile = "cpu"
models = "smollm2-135m,gemma3-270m"
seed = 0
device = "cpu"
filter_quantile = 0.5
max_tokens = 0  # 0 = use every kept token
matmul_dtype = "float32"  # per-chunk cross products (≈2× faster on CPU); sums stay float64

# %%
import pandas as pd

from actwave import index, plots
from actwave.capture import models as model_zoo
from actwave.notebook import notebook_setup
from actwave.profile import build
from actwave.stats import analysis, selection

NOTEBOOK, model_names, results_dir, _ = notebook_setup("02_layer_entropy", profile, models)
stores = index.open_stores(results_dir, model_names, "analysis")  # notebook 01's stores
settings = build("analysis", globals(), with_special=True)
stores, settings

# %% [markdown]
# ## Layer statistics
# Cached by `actwave.stats.analysis` (keyed by the capture and the token filter); the covariance
# blocks are dropped here, this notebook needs only the per-layer numbers.

# %%
stats = analysis.per_layer_stats(
    stores, settings, device)
num_layers = {name: max(stats[(name, "all tokens")].layers) for name in model_names}
default_layers = {name: selection.eagle3_default(n) for name, n in num_layers.items()}
default_layers

# %%
per_layer = pd.concat([plots.layer_table(s, model=name, token_set=label)
                       for (name, label), s in stats.items()], ignore_index=True)
per_layer["depth"] = per_layer["layer"] / per_layer["model"].map(num_layers)
plots.save_table(per_layer, "02_layer_entropy", NOTEBOOK, results_dir,
                 sort_by=["model", "token_set", "layer"])
kept = pd.DataFrame([{"model": name, "token_set": label, "n_tokens": s.n_tokens,
                      "n_seen": s.n_seen, "kept_fraction": s.kept_fraction}
                     for (name, label), s in stats.items()])
plots.save_table(kept, "02_kept_fraction", NOTEBOOK, results_dir, sort_by=["model", "token_set"])
kept

# %% [markdown]
# ## Entropy across depth, per model (Shannon and Rényi-2, three token sets)

# %%
for name in model_names:
    curves = per_layer[per_layer["model"] == name].rename(
        columns={"entropy": "Shannon H₁", "renyi2": "Rényi-2 H₂"}).melt(
        id_vars=["layer", "token_set"], value_vars=["Shannon H₁", "Rényi-2 H₂"],
        var_name="measure", value_name="nats")
    fig = plots.plot_layer_curves(curves, y="nats", hue="token_set", col="measure",
                                  marked_layers=default_layers[name], sharey=True,
                                  ylabel="matrix entropy (nats)", title=name)
    saved = plots.save_figure(fig, f"02_entropy_depth_{model_zoo.slug(name)}", NOTEBOOK)

# %% [markdown]
# ## All models on one relative-depth axis (normalised entropy H₁ / log min(n, d))

# %%
fig = plots.plot_layer_curves(per_layer[per_layer["token_set"] != "all + special"],
                              x="depth", y="entropy_norm", hue="model", style="token_set",
                              ylabel="normalised entropy", title="entropy across depth")
fig.axes[0].set_xlabel("relative depth ℓ / N")
saved = plots.save_figure(fig, "02_entropy_depth_all", NOTEBOOK)

# %% [markdown]
# ## Where the wave peaks, and what special tokens do
# Layer of maximal and minimal entropy per model and token set (candidates ℓ ≥ 1), and
# the largest per-layer change when special tokens are kept.

# %%
candidates = per_layer[per_layer["layer"] >= 1]
peaks = candidates.loc[candidates.groupby(["model", "token_set"])["entropy"].idxmax(),
                       ["model", "token_set", "layer", "entropy"]]
troughs = candidates.loc[candidates.groupby(["model", "token_set"])["entropy"].idxmin(),
                         ["model", "token_set", "layer", "entropy"]]
extremes = peaks.merge(troughs, on=["model", "token_set"], suffixes=("_max", "_min"))
plots.save_table(extremes, "02_entropy_extremes", NOTEBOOK, results_dir,
                 sort_by=["model", "token_set"])
wide = per_layer.pivot_table(index=["model", "layer"], columns="token_set", values="entropy")
special_shift = (wide["all + special"] - wide["all tokens"]).groupby("model").agg(["min", "max"])
print(extremes.to_string(index=False))
print("\nShannon entropy change when special tokens are kept (nats):")
print(special_shift.to_string())
