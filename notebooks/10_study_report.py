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
# # 10 — The layer-set study: verdicts with effect sizes and confidence intervals
#
# Reads only the committed records of notebook 08 (`results/<profile>/<model>/records/`)
# and its sets table, so it reruns in seconds on a fresh clone. Per model:
#
# - every set's offline τ̂ (mean ± SD over seeds) and its paired difference to the EAGLE-3
#   default on the same held-out positions, with a seed × sequence bootstrap CI
#   (`actwave.study.stats.paired_difference`; NA below 3 seeds, the sequence-only CI then);
# - the seed noise floor (pooled SD of τ̂ over seeds);
# - every selection proxy against τ̂ over all trained k = 3 sets: Spearman and Kendall with
#   permutation p-values;
# - the learning curve of the default (offline τ̂ vs training tokens, the study's budget
#   marked).

# %% tags=["parameters"]
profile = "study"
models = "smollm2-135m,gemma3-270m"
seed = 0
n_bootstrap = 1000
n_permutations = 10000

# %%
import pandas as pd

from actwave import plots
from actwave.capture import models as model_zoo
from actwave.notebook import notebook_setup
from actwave.study import report, runs

NOTEBOOK, model_names, results_dir, _ = notebook_setup("10_study_report", profile, models)
records = {name: runs.load_records(results_dir / model_zoo.slug(name)) for name in model_names}
sets = {name: pd.read_csv(results_dir / f"08_sets_{model_zoo.slug(name)}.csv")
        for name in model_names}
{name: len(r) for name, r in records.items()}

# %% [markdown]
# ## τ̂ per set and the paired difference to the default

# %%
summaries = {name: report.summary_table(records[name], n_bootstrap, seed)
             for name in model_names}
for name, table in summaries.items():
    slug = model_zoo.slug(name)
    plots.save_table(table, f"10_sets_vs_default_{slug}", NOTEBOOK, results_dir, sort_by=[])
    plots.save_figure(report.plot_set_taus(table, title=name), f"10_set_taus_{slug}",
                      NOTEBOOK)
floors = pd.DataFrame([{"model": name, "seed_sd_pooled": report.noise_floor(table)}
                       for name, table in summaries.items()])
plots.save_table(floors, "10_noise_floor", NOTEBOOK, results_dir)
floors

# %% [markdown]
# ## Does any proxy predict τ̂?

# %%
correlations = pd.concat([report.proxy_correlations(
    summaries[name], sets[name], n_permutations=n_permutations, seed=seed).assign(model=name)
    for name in model_names], ignore_index=True)
plots.save_table(correlations, "10_proxy_correlations", NOTEBOOK, results_dir,
                 sort_by=["model", "token_set", "proxy"])
for name in model_names:
    plots.save_figure(report.plot_proxy_vs_tau(summaries[name], sets[name], title=name),
                      f"10_proxy_vs_tau_{model_zoo.slug(name)}", NOTEBOOK)
correlations

# %% [markdown]
# ## Where in depth do the good sets sit? (exploratory)
# Chosen after seeing SmolLM2's ranking (sets holding the top layers ranked last), so these
# p-values describe, they do not confirm: the deepest, shallowest and mean layer of each
# trained triple and its spread, against τ̂.

# %%
depth = pd.concat([report.depth_correlations(
    summaries[name], n_permutations=n_permutations, seed=seed).assign(model=name)
    for name in model_names], ignore_index=True)
plots.save_table(depth, "10_depth_correlations", NOTEBOOK, results_dir,
                 sort_by=["model", "feature"])
depth

# %% [markdown]
# ## Learning curve of the default: where the budget sits

# %%
for name in model_names:
    curve = report.curve_table(records[name])
    if curve.empty:
        continue
    slug = model_zoo.slug(name)
    plots.save_table(curve, f"10_learning_curve_{slug}", NOTEBOOK, results_dir,
                     sort_by=["tokens"])
    budget = report.budget_tokens(records[name])
    plots.save_figure(report.plot_curve(curve, budget, title=name),
                      f"10_learning_curve_{slug}", NOTEBOOK)
