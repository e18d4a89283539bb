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
# # 07 — Speculative decoding: τ and speedup per layer set, and does the proxy predict τ?
#
# Every draft trained by notebook 06 (`results/<profile>/06_drafts.json`: model → label →
# draft folder under the cache dir) decodes MT-bench (`max_turns` turns), HumanEval and held-out
# ShareGPT prompts with its target at temperature 0, through the same comparison the
# benchmarks run (`actwave.decoding.fastpath.compare`): every linear layer under the GEMM
# formulation measured fastest on this machine (`routes = "measured"`), and two passes — the
# profile's fixed tree (with HF `generate` greedy and HF prompt lookup as peers) and the
# *auto* shape the cost model picks from this machine's measured cost curve and the drafts'
# held-out reach, plus lookup rounds (`decode_lookup`: a round that copies what followed an
# earlier occurrence of the last 2–3 tokens, where the cost model expects that to pay; τ and
# the score correlations below use the fixed pass, which has none). Each pass has its own
# plain greedy baseline (same routes, same prompts).
# τ = tokens emitted / verification rounds (bonus included); speedup = tokens/s ÷ our greedy
# tokens/s; 95% bootstrap CIs over prompts. Raw per-prompt records are saved beside the
# tables, and a rerun resumes from them.
#
# Then: measured τ against the selection scores of notebook 05 (`05_selection.csv`), with
# Spearman and Kendall rank correlations over all trained drafts, and the acceptance rate
# per draft position.

# %% tags=["parameters"]
profile = "cpu"
train_models = "smollm2-135m"  # models with drafts from notebook 06
device = "cpu"
seed = 0
# the harness (EvalConfig)
eval_dtype = "float32"  # fp32: speculative output must equal greedy exactly
benchmarks = "mtbench,humaneval,sharegpt"
n_prompts = 2
max_turns = 1
max_new_tokens = 64
max_prompt_tokens = 1024
mode = "tree"
eval_depth = 4
top_k = 4
total_tokens = 16
peers = True
n_bootstrap = 1000
routes = "measured"  # "stock": F.linear as shipped (actwave.decoding.linear_routes)
acceptance_prompts = 16  # held-out prompts of the same benchmarks behind the auto shape
decode_lookup = True  # the auto shape may add prompt-lookup rounds (actwave.decoding.lookup)

# %%
import matplotlib.pyplot as plt
import pandas as pd
import torch

from actwave import index, plots
from actwave.capture import models as model_zoo
from actwave.decoding import evaluate, fastpath, report
from actwave.notebook import notebook_setup
from actwave.profile import build

NOTEBOOK, model_names, results_dir, log = notebook_setup("07_speculative", profile, train_models)
config = build("eval", globals())
draft_dirs = index.read_index(results_dir, index.DRAFTS, model_names)  # notebook 06's drafts
config, draft_dirs

# %% [markdown]
# ## Decoding runs (one per model; all methods side by side on each prompt)

# %%
comparisons, layer_sets = {}, {}
for name in model_names:
    target, tokenizer = model_zoo.load(name, dtype=getattr(torch, config.dtype), device=device)
    drafts = evaluate.load_drafts(target, draft_dirs[name])
    layer_sets[name] = {label: tuple(draft.layer_ids) for label, draft in drafts.items()}
    comparisons[name] = fastpath.compare(
        target, tokenizer, drafts, build("eval", globals(), model=name),
        model_zoo.stop_token_ids(tokenizer, name), routes=routes,
        acceptance_prompts=acceptance_prompts, lookup=decode_lookup, out_dir=results_dir,
        run_name=f"{NOTEBOOK}_records_{model_zoo.slug(name)}")
    print(name, "routes:", routes, "| fixed:", comparisons[name].shape_label("fixed"),
          "|", comparisons[name].shape_label("auto"))
    del target, drafts

# %% [markdown]
# ## Main table: τ and speedup (95% CI) per layer set, benchmark and shape, with the peer rows
# `shape` and `routes` say what ran; `exact_match_rate`: share of prompts whose output equals
# our greedy.

# %%
summary = pd.concat([c.summary().assign(model=name) for name, c in comparisons.items()])
plots.save_table(summary, f"{NOTEBOOK}_summary", NOTEBOOK, results_dir,
                 sort_by=["model", "pass", "benchmark", "label"])
main = pd.concat([report.main_table(run["summary"], layer_sets[name])
                  .assign(model=name, shape=c.shape_label(pass_name), routes=c.routes)
                  for name, c in comparisons.items() for pass_name, run in c.runs.items()])
main = main[["model", "shape"] + [col for col in main.columns if col not in ("model", "shape")]]
plots.save_table(main, f"{NOTEBOOK}_main", NOTEBOOK, results_dir, sort_by=["model", "shape", "label"])
main

# %% [markdown]
# ## Does the selection score predict τ?
# Scores of each trained draft's layer set (notebook 05, per token set) against
# its τ pooled over benchmarks, with the fixed shape (one shape for every draft: the deeper
# one, so τ spreads more than with a short auto chain); rank correlations per model and pooled ("all": ranks taken
# within each model first). A handful of drafts per model: read the p-values.

# %%
taus = pd.DataFrame([{"model": name, "label": row.label,
                      "layer_ids": layer_sets[name][row.label], "tau": row.tau}
                     for name, c in comparisons.items()
                     for row in c.runs["fixed"]["summary"].itertuples()
                     if row.benchmark == "all" and row.label in layer_sets[name]])
selection_path = results_dir / "05_selection.csv"
if selection_path.exists():
    joined, correlations = report.tau_vs_scores(taus, report.read_selection_scores(selection_path))
else:
    log.warning("%s missing: run notebook 05 for the score correlations", selection_path)
    joined, correlations = taus.iloc[:0].assign(token_set="", score="", value=0.0), pd.DataFrame()
if not correlations.empty:
    plots.save_table(correlations, f"{NOTEBOOK}_tau_vs_score", NOTEBOOK, results_dir,
                     sort_by=["model", "token_set", "score"])
correlations

# %%
shown = joined[~joined["score"].str.endswith("_pct")]
if not shown.empty:
    plots.save_figure(plots.plot_tau_vs_score(shown), f"{NOTEBOOK}_tau_vs_score", NOTEBOOK)

# %% [markdown]
# ## Acceptance per draft position
# `reach`: share of verification rounds that accepted at least i draft tokens;
# `conditional`: P(accept ≥ i | accept ≥ i − 1).

# %%
acceptance = pd.concat([run["acceptance"].assign(model=name, shape=c.shape_label(pass_name))
                        for name, c in comparisons.items() for pass_name, run in c.runs.items()])
plots.save_table(acceptance, f"{NOTEBOOK}_acceptance", NOTEBOOK, results_dir,
                 sort_by=["model", "shape", "benchmark", "label", "position"])
for name in model_names:
    fixed_shape = comparisons[name].shape_label("fixed")
    fig = plots.plot_acceptance(acceptance[(acceptance["model"] == name)
                                           & (acceptance["shape"] == fixed_shape)],
                                title=f"{name}: acceptance per draft position")
    plots.save_figure(fig, f"{NOTEBOOK}_acceptance_{model_zoo.slug(name)}", NOTEBOOK)
    plt.close(fig)
