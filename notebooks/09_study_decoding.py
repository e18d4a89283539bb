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
# # 09 — Decoding check: does offline τ̂ hold up in real speculative decoding?
#
# Per model, three drafts of the study (notebook 08's records): the EAGLE-3 default, the
# selected set and the random set with the highest offline τ̂ (seed 0 each). Each decodes
# MT-bench (both turns), HumanEval and held-out ShareGPT prompts at temperature 0 in fp32
# through the benchmarks' comparison (`actwave.decoding.fastpath.compare`): every linear under
# the GEMM route measured fastest here (`routes`), first by chain speculative decoding of depth
# K (the depth of offline acceptance), then with the auto shape of the measured cost curve,
# each beside our plain greedy decoding on the same prompts: τ, speedup, exactness, and a
# paired bootstrap over prompts (chain pass). Raw records are committed beside the tables and a rerun
# resumes from them. Then: decoding τ against offline τ̂ and the offline decoding walk
# (`actwave.decoding.acceptance.decode_walk`) of the same drafts.

# %% tags=["parameters"]
profile = "study"
models = "smollm2-135m,gemma3-270m"
seed = 0
device = "cpu"
# the decoding harness (EvalConfig; depth: the study's K)
eval_dtype = "float32"
benchmarks = "mtbench,humaneval,sharegpt"
n_prompts = 20
max_turns = 2
max_new_tokens = 32
mode = "chain"
peers = False
n_bootstrap = 1000
routes = "measured"  # "stock": F.linear as shipped (actwave.decoding.linear_routes)
acceptance_prompts = 16  # held-out prompts of the same benchmarks behind the auto shape

# %%
import pandas as pd

from actwave import index, plots
from actwave.capture import models as model_zoo
from actwave.capture.store import DTYPES
from actwave.decoding import fastpath
from actwave.notebook import notebook_setup
from actwave.profile import build
from actwave.study import report, runs

NOTEBOOK, model_names, results_dir, _ = notebook_setup("09_study_decoding", profile, models)

# %%
summaries, agreement, paired = [], [], []
for name in model_names:
    out = results_dir / model_zoo.slug(name)
    records = report.main_records(runs.load_records(out))
    chosen = runs.decoding_sets(records)
    config = runs.StudyConfig.from_flat(chosen["eagle3_default"]["study"])  # as recorded
    target, tokenizer = model_zoo.load(name, dtype=DTYPES[eval_dtype], device=device)
    stores = {split: index.open_stores(results_dir, [name], split, index.STUDY_STORES)[name]
              for split in ("train", "eval")}  # notebook 08's
    drafts = {label: runs.load_draft(record, config, target, stores)
              for label, record in chosen.items()}
    eval_config = build("eval", globals(), model=name, depth=config.depth)
    comparison = fastpath.compare(target, tokenizer, drafts, eval_config,
                                  model_zoo.stop_token_ids(tokenizer, name), routes=routes,
                                  acceptance_prompts=acceptance_prompts, out_dir=out,
                                  run_name="09_decoding")
    result = comparison.runs["fixed"]  # the chain of depth K: the offline walk's decoding
    summaries.append(comparison.summary().assign(model=name))
    agreement += [{"model": name, **report.offline_vs_decoding(chosen[label], result["records"],
                                                               label)}
                  for label in chosen]
    paired += [{"model": name, **report.paired_decoding(
        result["records"], label, n_bootstrap=n_bootstrap, seed=seed)}
        for label in chosen if label != report.REFERENCE]
summary = pd.concat(summaries, ignore_index=True)
plots.save_table(summary, "09_decoding_summary", NOTEBOOK, results_dir)
plots.save_table(pd.DataFrame(paired), "09_decoding_vs_default", NOTEBOOK, results_dir)
summary

# %% [markdown]
# ## Offline τ̂ vs decoding τ
# Decoding τ on the held-out ShareGPT prompts (the eval split the offline scores use) and
# on every benchmark, against the offline position-mean τ̂ and the offline decoding walk.

# %%
agreement = pd.DataFrame(agreement)
plots.save_table(agreement, "09_offline_vs_decoding", NOTEBOOK, results_dir,
                 sort_by=["model", "label"])
fig = report.plot_offline_vs_decoding(agreement)
plots.save_figure(fig, "09_offline_vs_decoding", NOTEBOOK)
agreement
