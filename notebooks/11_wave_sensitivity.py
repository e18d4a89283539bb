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
# # 11 · Is the wave real? Sensitivity of the entropy curve, the selected sets and the compartments
#
# The analysis notebooks (02–05) read one entropy curve, one CKA geometry and one set of
# picks per model and token set. Here each is recomputed under perturbations that
# should not matter if the "wave" is a property of the model and not of the estimator:
#
# * **token filter** — keep tokens whose predictive entropy is at least the q-quantile,
#   q ∈ `sensitivity_quantiles` (0 = every non-special token);
# * **row normalisation** — every token's state at every layer scaled to unit L2 norm
#   before the statistics (as Skean et al. 2025 do), at q ∈ `normalized_quantiles`; a
#   token with a massive activation then weighs no more than any other;
# * **outlier dimensions** — the share λ_max / Σλ of the top covariance eigenvalue per
#   layer: near 1, one direction carries the variance and the entropy measures little else;
# * **compartments** (contiguous blocks of mutually similar layers, maximal generalised
#   modularity Q_γ of the debiased CKA matrix) at resolutions γ ∈ `resolutions`, on the
#   full analysis split and in `n_boot` bootstrap replicates over sequences
#   (each on ≤ `boot_tokens` tokens, debiased linear CKA by the Gram route,
#   `actwave.stats.sensitivity.bootstrap_compartments`).
#
# Same capture (the analysis split of notebooks 01–05) and statistics precision as the
# analysis notebooks; the variants at q = 0 and q = 0.5 reuse their caches.

# %% tags=["parameters"]
profile = "study"
models = "smollm2-135m,gemma3-270m"
seed = 0
device = "cpu"
# the analysis split (CaptureConfig)
capture_n_sequences = 64
capture_max_seq_len = 512
capture_batch_size = 4
capture_dtype = "float32"
matmul_dtype = "float32"  # per-chunk cross products (≈2× faster on CPU); sums stay float64
sensitivity_quantiles = "0,0.25,0.5,0.75"  # token-filter quantiles; 0 keeps every non-special token
normalized_quantiles = "0,0.5"  # quantiles also run on row-normalised states
# the compartment bootstrap (BootstrapConfig)
n_boot = 20  # bootstrap replicates over sequences
boot_tokens = 3000  # at most this many tokens per replicate
resolutions = "0.75,1.0,1.25,1.5"  # modularity resolutions γ of the compartments
sensitivity_methods = "renyi2_exhaustive,logdet_dpp,mrmr,entropy_topk,cka_compartments,greedy_aggregate_entropy"

# %%
import pandas as pd

from actwave import index, plots
from actwave.capture import models as model_zoo
from actwave.capture.store import analysis_captures, run_capture
from actwave.notebook import notebook_setup
from actwave.profile import build, section
from actwave.stats import analysis, selection, sensitivity

NOTEBOOK, model_names, results_dir, _ = notebook_setup("11_wave_sensitivity", profile, models)
variants = sensitivity.variant_configs(
    sensitivity.parse_values(sensitivity_quantiles, "sensitivity_quantiles", 0, 1),
    sensitivity.parse_values(normalized_quantiles, "normalized_quantiles", 0, 1),
    seed=seed, matmul_dtype=matmul_dtype)
boot_config = build("bootstrap", globals())
gammas = boot_config.resolutions
selection_config = build("selection", globals())
captures = analysis_captures(model_names, **section(globals(), "capture"), seed=seed)
# the analysis split (captured by notebook 01 or 08; captured here if neither ran)
stores = {name: run_capture(captures[name], device=device) for name in model_names}
default_layers = {name: selection.eagle3_default(s.num_layers) for name, s in stores.items()}
variants, default_layers

# %% [markdown]
# ## One pass per model and variant
# Full statistics (covariance blocks included: the top-eigenvalue share and the greedy
# Shannon method need them), loaded one at a time: per-layer entropies and top share, the
# selected sets with their percentiles among all C(N, 3) subsets, and the compartments of
# the variant's debiased CKA at every resolution.

# %%
per_layer, picks, segmented = [], [], []
for name in model_names:
    for label, config in variants.items():
        stats = analysis.compute_layer_stats(stores[name], config, device=device)
        tags = {"model": name, "variant": label, "quantile": config.filter_value,
                "row_normalize": config.row_normalize}
        table = plots.layer_table(stats, **tags)
        table["top_eigen_share"] = plots.as_numpy(sensitivity.top_eigen_shares(stats))
        per_layer.append(table)
        picks += [{**tags, **row} for row in sensitivity.selected_sets(
            stats, selection_config, index.names(sensitivity_methods))]
        segmented += [{**tags, "resolution": gamma, "segmentation": sensitivity.format_blocks(b),
                       **sensitivity.coverage(b, default_layers[name])}
                      for gamma, b in sensitivity.segmentations(
                          stats.cka, gammas, stats.layers).items()]
        del stats
per_layer = pd.concat(per_layer, ignore_index=True)
picks = pd.DataFrame(picks).rename(columns={"layers": "layer_ids"})  # compare_methods: "layers"
segmented = pd.DataFrame(segmented)
order = {label: i for i, label in enumerate(variants)}
plots.save_table(per_layer, "11_entropy_variants", NOTEBOOK, results_dir,
                 sort_by=["model", "variant", "layer"])
plots.save_table(picks[["model", "variant", "quantile", "row_normalize", "label", "layer_ids",
                        "renyi2", "renyi2_pct", "logdet_pct", "entropy_sum_pct",
                        "dispersion_pct"]],
                 "11_selected_sets", NOTEBOOK, results_dir, sort_by=["model", "variant", "label"])
plots.save_table(segmented, "11_compartments_variants", NOTEBOOK, results_dir,
                 sort_by=["model", "variant", "resolution"])
per_layer.groupby(["model", "variant"], sort=False)["top_eigen_share"].agg(["min", "max"])

# %% [markdown]
# ## Entropy curves and the top-eigenvalue share, per variant
# Left: Shannon matrix entropy per layer. Right: λ_max / Σλ per layer (log scale); the
# EAGLE-3 default layers are dotted.

# %%
for name in model_names:
    curves = per_layer[per_layer["model"] == name].rename(
        columns={"entropy": "Shannon H₁ (nats)", "top_eigen_share": "λ_max / Σλ"}).melt(
        id_vars=["layer", "variant"], value_vars=["Shannon H₁ (nats)", "λ_max / Σλ"],
        var_name="measure", value_name="value")
    fig = plots.plot_layer_curves(curves, y="value", hue="variant", col="measure",
                                  marked_layers=default_layers[name], ylabel="",
                                  title=f"{name}: entropy and top-eigenvalue share per variant")
    fig.axes[1].set_yscale("log")
    saved = plots.save_figure(fig, f"11_entropy_variants_{model_zoo.slug(name)}", NOTEBOOK)

# %% [markdown]
# ## Do the picks move? Each method's set and the default's Rényi-2 percentile per variant
# `picks_changed` counts the variants whose set differs from the method's set on all
# tokens (raw states).

# %%
picks["layer_ids"] = picks["layer_ids"].map(tuple)
reference = picks[picks["variant"] == "all tokens"].set_index(["model", "label"])["layer_ids"]
picks["same_as_all_tokens"] = [layers == reference[(m, lab)] for m, lab, layers in
                               zip(picks["model"], picks["label"], picks["layer_ids"])]
stability = (picks.groupby(["model", "label"])
             .agg(distinct_sets=("layer_ids", "nunique"),
                  picks_changed=("same_as_all_tokens", lambda same: int((~same).sum())))
             .reset_index())
plots.save_table(stability, "11_pick_stability", NOTEBOOK, results_dir, sort_by=["model", "label"])
wide = (picks.set_index(["model", "label", "variant"])["layer_ids"]
        .unstack("variant")[list(variants)])
fig = plots.plot_method_scores(picks.sort_values("variant", key=lambda v: v.map(order)),
                               method="label", value="renyi2_pct", hue="variant", col="model",
                               xlabel="percentile of H₂ among all C(N, 3) sets",
                               title="each method's set under each variant")
saved = plots.save_figure(fig, "11_selected_sets_percentile", NOTEBOOK)
print(wide.to_string())
stability

# %% [markdown]
# ## Compartments: bootstrap over sequences, per resolution
# Each replicate draws the analysis split's sequences with replacement, keeps at most
# `boot_tokens` of their non-special tokens, computes debiased CKA between all layers and
# the compartments at every γ. `share` = fraction of replicates giving that segmentation
# (sums to 1 per γ); `full_data` marks the segmentation of the whole split (streaming CKA
# over every non-special token, raw states).

# %%
boot_segments, boot_boundaries, boot_default = [], [], []
for name in model_names:
    keep, _ = analysis.token_keep_mask(stores[name], variants["all tokens"])
    records = sensitivity.bootstrap_compartments(stores[name], keep, boot_config)
    full = segmented[(segmented["model"] == name) & (segmented["variant"] == "all tokens")]
    full_segmentation = dict(zip(full["resolution"], full["segmentation"]))
    boot_segments += [{"model": name, **row,
                       "full_data": row["segmentation"] == full_segmentation[row["resolution"]]}
                      for row in sensitivity.segmentation_shares(records)]
    boot_boundaries += [{"model": name, **row} for row in sensitivity.boundary_shares(records)]
    boot_default += [{"model": name, "default_layers": default_layers[name], **row}
                     for row in sensitivity.default_coverage(records, default_layers[name])]
boot_segments, boot_boundaries = pd.DataFrame(boot_segments), pd.DataFrame(boot_boundaries)
boot_default = pd.DataFrame(boot_default)
plots.save_table(boot_segments, "11_boot_segmentations", NOTEBOOK, results_dir,
                 sort_by=["model", "resolution", "segmentation"])
plots.save_table(boot_boundaries, "11_boot_boundaries", NOTEBOOK, results_dir,
                 sort_by=["model", "resolution", "boundary_before_layer"])
boot_segments.sort_values("share", ascending=False).groupby(["model", "resolution"]).head(2)

# %% [markdown]
# Share of replicates with a compartment opening at each layer (one line per γ); a
# boundary that exists in the data appears at the same layer in most replicates.

# %%
for name in model_names:
    grid = pd.MultiIndex.from_product([gammas, range(1, stores[name].num_layers + 1)],
                                      names=["resolution", "boundary_before_layer"])
    shares = (boot_boundaries[boot_boundaries["model"] == name]
              .set_index(["resolution", "boundary_before_layer"])["share"]
              .reindex(grid, fill_value=0.0).reset_index())
    shares["resolution"] = shares["resolution"].map(lambda g: f"γ = {g:g}")
    fig = plots.plot_layer_curves(shares, x="boundary_before_layer", y="share",
                                  hue="resolution", marked_layers=default_layers[name],
                                  ylabel="share of replicates",
                                  title=f"{name}: compartment boundaries "
                                        f"({n_boot} bootstrap replicates)")
    saved = plots.save_figure(fig, f"11_boot_boundaries_{model_zoo.slug(name)}", NOTEBOOK)

# %% [markdown]
# ## Is the default competitive because it puts one layer in each compartment?
# Per model and γ: the full-data segmentation and whether the EAGLE-3 default
# (2, N//2, N−3) hits every compartment of it; over the bootstrap replicates, the share in
# which the default hits every compartment (`hits_all_share`) and the share in which no two
# of its layers share one (`one_per_block_share`); the share of replicates that reproduce
# the full-data segmentation; and the default's H₂ percentile on all tokens. The
# explanation survives only where the default hits every compartment in most replicates
# *and* the segmentation itself is stable.

# %%
full_all = segmented[segmented["variant"] == "all tokens"].set_index(["model", "resolution"])
stable = boot_segments[boot_segments["full_data"]].set_index(["model", "resolution"])["share"]
default_pct = picks[(picks["label"] == "eagle3_default") & (picks["variant"] == "all tokens")] \
    .set_index("model")["renyi2_pct"]
verdict = boot_default.join(full_all[["segmentation", "hits_all"]].rename(
    columns={"segmentation": "full_data_segmentation", "hits_all": "full_data_hits_all"}),
    on=["model", "resolution"])
verdict["full_data_reproduced_share"] = [stable.get((m, g), 0.0) for m, g in
                                         zip(verdict["model"], verdict["resolution"])]
verdict["default_renyi2_pct"] = verdict["model"].map(default_pct)
plots.save_table(verdict, "11_default_compartments", NOTEBOOK, results_dir,
                 sort_by=["model", "resolution"])
for row in verdict.itertuples():
    print(f"{row.model} γ={row.resolution:g}: full data {row.full_data_segmentation} "
          f"(default hits all: {row.full_data_hits_all}; reproduced in "
          f"{row.full_data_reproduced_share:.0%} of replicates); default hits every "
          f"compartment in {row.hits_all_share:.0%}, one layer per compartment in "
          f"{row.one_per_block_share:.0%} of replicates; H₂ percentile "
          f"{row.default_renyi2_pct:.1f}")
verdict
