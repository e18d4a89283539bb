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
# # 12 — The study at matched, decayed budgets: does the answer hold for drafts that learned?
#
# The 1× study (notebooks 08–10) trains each draft 64 steps: one epoch of ~24k tokens, τ̂ ≈
# 1.18, the learning curve still rising. Here every pre-registered set (README, "The
# study's next step") gets one warmup-stable-decay run per seed, and a decayed branch at each
# budget (1×, 4×, 16×, 32× the 64 steps; `actwave.eagle3.schedule`) is scored with offline
# τ̂ on held-out text (`actwave.study.longrun`): drafts of one set are compared with the
# default only at matched, fully decayed checkpoints. Text: the target's own regenerated
# replies where it has a pool (`profiles/data/pools.yaml`: SmolLM2), else ShareGPT's
# original replies (Gemma-3, whose greedy replies loop). One small record per (set, seed,
# budget) under `results/<profile>/long/<model>/records/`, committed: a rerun (or a fresh
# clone) trains only what is missing: the 1× and 4× budgets across every set and seed first,
# then one (seed, set) trunk at a time through 16× and 32× (seed 0 of every set first).
#
# Then: per model × budget × set, τ̂ (seed mean, SD, range), the paired Δ to the default
# with a seed × sequence bootstrap CI and Holm-adjusted p (the pre-registered primary
# comparison unadjusted); the rank stability of the sets across budgets; τ̂ vs budget.

# %% tags=["parameters"]
profile = "study"
models = "smollm2-135m,gemma3-270m"
seed = 0
device = "cpu"
# the analysis split behind the proxies of the key sets (notebooks 01-05 and 08: shared cache)
capture_n_sequences = 64
capture_max_seq_len = 512
capture_batch_size = 4
capture_dtype = "float32"
filter_quantile = 0.5
matmul_dtype = "float32"
longrun_sets = ""  # "": the pre-registered key sets; "all"; or comma-separated labels of notebook 08
longrun_seeds = 3
# the budgets and their schedule (LongRunConfig)
base_steps = 64
multipliers = "1,4,16,32"
longrun_warmup_steps = 6
min_decay = 16  # decay branch: max(ceil(0.2·budget), this) steps
longrun_draft_vocab_size = 16384  # the draft's output vocabulary (LongRunConfig)
longrun_train_conversations = 3200
longrun_eval_conversations = 400
longrun_max_jobs = -1  # -1: every missing job; 0: report the committed records only
n_bootstrap = 1000
n_permutations = 10000
# decoding check of one seed's drafts at the largest budget (EvalConfig; chain depth = ttt_steps)
longrun_decode_seed = 1
eval_dtype = "float32"
benchmarks = "mtbench,humaneval,sharegpt"
longrun_decode_prompts = 20  # per benchmark
max_turns = 2
longrun_decode_new_tokens = 64
# held-out ShareGPT's first 20 prompts reach 2,099 tokens (SmolLM2's tokenizer): 1,024 would drop 3
longrun_decode_max_prompt_tokens = 2304
routes = "measured"  # "stock": F.linear as shipped (actwave.decoding.linear_routes)
acceptance_prompts = 16  # held-out prompts of the same benchmarks behind the auto shape

# %%
import pandas as pd

from actwave import plots
from actwave.capture import models as model_zoo
from actwave.capture.store import analysis_captures
from actwave.notebook import notebook_setup
from actwave.profile import build, section
from actwave.study import longdecode, longrun, report, runs

NOTEBOOK, model_names, results_dir, _ = notebook_setup("12_study_long", profile, models)
labels = longrun_sets if longrun_sets in ("", "all") else longrun_sets.split(",")

# %% [markdown]
# ## Runs: what is done, what is missing, and the missing jobs in order

# %%
for name in model_names:
    config = build("longrun", globals(), model=name)
    sets = longrun.study_sets(name, labels or None, longrun_seeds, results_dir)
    jobs = longrun.plan(sets, config.budgets)
    folder = longrun.results_folder(name, results_dir)
    status = longrun.status(jobs, folder, config.schedule())
    print(name, [s.label for s in sets], f"done {len(status['done'])}/{len(jobs)}",
          f"about {status['remaining_seconds'] / 3600:.1f} h left")
    if longrun_max_jobs != 0 and status["missing"]:
        run = longrun.prepare(name, config, sets, longrun_train_conversations,
                              longrun_eval_conversations, results=folder)
        longrun.run_jobs(jobs, run, None if longrun_max_jobs < 0 else longrun_max_jobs)
        del run

# %% [markdown]
# ## τ̂ per budget and set, the paired difference to the default, and rank stability
# `diff`, `ci_low`, `ci_high`: τ̂(set) − τ̂(default) with the seed × sequence bootstrap CI;
# `p_holm`: Holm-adjusted per budget (the primary comparison, `primary`, unadjusted).
# Rank stability: Spearman and Kendall (permutation p) between the sets' rankings at
# successive budgets and at each budget vs the largest (`predicts`: ρ > 0, p < 0.05), over
# the budgets that hold every seed (`seeds` "all") and over seed 0 alone (`seeds` "0").
# Costs: per budget, one draft's training seconds (trunk to the branch point + its decay) and
# scoring seconds, medians over all jobs and over those that ran alone (`idle`).
# Steps: per draft step, TTT agreement vs chained acceptance, the acceptance given a right
# prefix (`conditional`) and the chain independent errors would give (`report.step_table`).

# %%
tables = {}
for name in model_names:
    records = longrun.load_records(longrun.results_folder(name, results_dir))
    if not records:
        print(name, "no long-run records yet")
        continue
    tables[name] = report.long_tables(records, n_bootstrap, n_permutations, seed)
    slug = model_zoo.slug(name)
    plots.save_table(tables[name]["sets"], f"{NOTEBOOK}_sets_{slug}", NOTEBOOK, results_dir,
                     sort_by=["budget", "label"])
    plots.save_table(tables[name]["costs"], f"{NOTEBOOK}_costs_{slug}", NOTEBOOK, results_dir)
    plots.save_table(tables[name]["steps"], f"{NOTEBOOK}_steps_{slug}", NOTEBOOK, results_dir)
    fig = report.plot_tau_vs_budget(tables[name]["sets"], title=name)
    plots.save_figure(fig, f"{NOTEBOOK}_tau_vs_budget_{slug}", NOTEBOOK)
if tables:
    stability = pd.concat([t["rank_stability"].assign(model=model_zoo.slug(name))
                                 for name, t in tables.items()], ignore_index=True)
    plots.save_table(stability, f"{NOTEBOOK}_rank_stability", NOTEBOOK, results_dir,
                     sort_by=["model", "seeds", "comparison", "train_steps"])
    stability

# %% [markdown]
# ## What the proxies predict as drafts learn
# Every selection score of notebook 08 (`runs.set_proxies`: Rényi-2 and Shannon aggregate
# entropy, log-det, entropy sum, CKA dispersion; all tokens and entropy-filtered) of each key
# set, from the analysis split's layer statistics, against the sets' seed-mean τ̂ at each
# budget: Spearman and Kendall with permutation p (`report.long_proxy_correlations`). Six
# sets: only |ρ| ≥ 0.89 reaches p < 0.05.

# %%
settings = dict(zip(runs.SETTINGS, build("analysis", globals()).values()))
captures = analysis_captures(list(tables), **section(globals(), "capture"), seed=seed)
proxy_tables = []
for name in tables:
    sets = longrun.study_sets(name, labels or None, longrun_seeds, results_dir)
    proxies = pd.DataFrame(runs.proxies_of(sets, captures[name], settings, device))
    proxy_tables.append(report.long_proxy_correlations(
        tables[name]["sets"], proxies, n_permutations, seed).assign(model=model_zoo.slug(name)))
if proxy_tables:
    proxy_correlations = pd.concat(proxy_tables, ignore_index=True)
    plots.save_table(proxy_correlations, f"{NOTEBOOK}_proxy_correlations", NOTEBOOK, results_dir,
                     sort_by=["model", "token_set", "proxy", "budget"])
    proxy_correlations

# %% [markdown]
# ## Decoding check: the trained drafts at the largest budget
# Every set's draft of seed `longrun_decode_seed` at the largest budget decodes MT-bench,
# HumanEval and held-out ShareGPT prompts through the benchmarks' comparison
# (`actwave.decoding.fastpath`: the chain of depth `ttt_steps`, and the auto shape, under
# the measured linear routes), with speedups and bootstrap CIs vs our routed greedy. A draft
# lives only in the cache of the machine that trained it, so each is decoded alone, on that
# machine, right after its job (`actwave.study.longdecode`; `actwave longrun` does it, and
# this cell does it for any such draft here that is not decoded yet); its tables are
# committed, and this cell gathers them (the `draft_*` columns say which run each row is
# from; each run has its own greedy reference and auto shape). `walk`: per chain record, the
# offline walk over the same greedy text (one target forward, per-position acceptance)
# against the decoding τ; `equal` must hold for every record in float32. SmolLM2's committed
# tables come from the earlier joint run of its six seed-1 drafts (one shape for all).

# %%
decoded = {}
for name in model_names:
    config = build("longrun", globals(), model=name)
    folder = longrun.results_folder(name, results_dir)
    sets = longrun.study_sets(name, labels or None, longrun_seeds, results_dir)
    set_labels, budget = [s.label for s in sets], max(config.budgets)
    records = [r for r in longrun.load_records(folder) if r["label"] in set_labels]
    fresh = longdecode.decode_due(name, records, budget, longrun_decode_seed, globals(),
                                  config.ttt_steps, folder, longrun.work_folder(name))
    result = longdecode.decoded_tables(folder, records, set_labels, budget, longrun_decode_seed)
    if result is None:
        print(name, f"no draft of seed {longrun_decode_seed} at {budget} steps is decoded yet: "
              "the committed decoding tables are kept")
        continue
    decoded[name] = result
    slug = model_zoo.slug(name)
    plots.save_table(result["summary"], f"{NOTEBOOK}_decoding_{slug}", NOTEBOOK, results_dir)
    walk = result["walk"].groupby(["draft_seed", "label", "benchmark"], as_index=False).agg(
        records=("equal", "size"), equal=("equal", "sum"), decoding_tau=("decoding_tau", "mean"),
        walk_tau=("walk_tau", "mean"))
    plots.save_table(walk, f"{NOTEBOOK}_walk_check_{slug}", NOTEBOOK, results_dir)
    print(name, f"seed {longrun_decode_seed}: {walk.label.nunique()}/{len(set_labels)} sets "
          f"decoded ({len(fresh)} in this run); offline walk = decoding τ on "
          f"{int(walk.equal.sum())}/{int(walk.records.sum())} records")
