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
# # 06 — Train one EAGLE-3 draft per candidate layer set
#
# For every layer set that notebook 05 proposed (`results/<profile>/05_candidate_sets.json`,
# `{model: {label: [layers]}}`), train an EAGLE-3 draft (fc over the k target states, one
# decoder layer, frozen target embedding, frequency-built draft vocabulary) from the `train`
# capture store of notebook 01, with the training-time test unrolled `train_ttt_steps` steps and
# the loss Σ γ^i · soft-CE (`actwave.eagle3.train`). The target is never re-run: its soft
# labels come from the stored ℓ=N state through its final norm + LM head.
#
# Held-out top-1 agreement with the target (draft argmax == target argmax, per TTT step)
# is scored on the first `train_eval_sequences` sequences of the disjoint `analysis` store at
# every checkpoint. Drafts are cached under `<cache>/drafts/` (`actwave.index.draft_dir`:
# `<model>-L<layers>-s<seed>-<key>`, the key hashing the training config, the target and
# both stores: `index.draft_key`), so a rerun skips finished drafts and resumes interrupted
# ones. The stores come from notebook 01's index `01_stores.json`. `results/<profile>/06_drafts.json` maps model → label → draft folder (relative to
# the cache dir) for notebook 07.

# %% tags=["parameters"]
profile = "cpu"
train_models = "smollm2-135m"  # models that get drafts (notebook 01 captured their train split)
seed = 0
device = "cpu"
# draft training (TrainConfig); cpu: fp32 ~2.7 s per step of 2 × 512 tokens on 2 cores (SmolLM2)
train_total_steps = 48
train_warmup_steps = 5
train_ttt_steps = 3
train_gamma = 0.8
train_lr = 0.001
train_batch_size = 2
train_max_seq_len = 512
train_draft_vocab_size = 8192
train_lm_head_init = "random"
train_dtype = "float32"
train_checkpoint_every = 16
train_eval_sequences = 8

# %%
import pandas as pd

from actwave import index, plots
from actwave.capture import models as model_zoo
from actwave.capture.store import DTYPES
from actwave.eagle3.train import train_draft
from actwave.notebook import notebook_setup
from actwave.profile import build

NOTEBOOK, model_names, results_dir, log = notebook_setup("06_train_drafts", profile, train_models)
train_stores = index.open_stores(results_dir, model_names, "train")
eval_stores = index.open_stores(results_dir, model_names, "analysis")
candidate_sets = index.read_index(results_dir, index.CANDIDATE_SETS, model_names)
candidate_sets

# %% [markdown]
# ## Training (one draft per distinct layer set; labels naming the same set share it)

# %%
runs, manifest = {}, {}
for name in model_names:
    target, _ = model_zoo.load(name, dtype=DTYPES["float32"], device=device)
    train_store, eval_store = train_stores[name], eval_stores[name]
    for label, layers in sorted(candidate_sets[name].items()):
        config = build("train", globals(), layer_ids=tuple(layers))
        key = index.draft_key(name, config, train_store, eval_store)
        out_dir = index.draft_dir(name, config, key)
        result = train_draft(train_store, target, config, out_dir, eval_store=eval_store)
        runs[name, label] = result
        manifest.setdefault(name, {})[label] = index.cache_relative(result.draft_dir)
        log.info("%s %s %s: %.0f s", name, label, layers, result.seconds)
    del target
plots.save_json(manifest, index.DRAFTS, NOTEBOOK, results_dir)

# %% [markdown]
# ## Summary: final training loss and held-out top-1 agreement per TTT step
# `train_loss` = mean Σγ^i loss over the last 10% of steps; `acc_i` = held-out agreement at
# TTT step i (the draft's (i+1)-th token in a chain); `seconds` = wall time of training.

# %%
rows = []
for (name, label), result in runs.items():
    history = pd.DataFrame(result.history)
    tail = history.tail(max(1, len(history) // 10))
    rows.append({"model": name, "label": label, "layer_ids": list(result.draft.layer_ids),
                 "steps": len(history), "train_loss": tail["loss"].mean(),
                 "seconds": result.seconds,
                 **{k: v for k, v in result.metrics.items() if k.startswith("acc_")}})
summary = pd.DataFrame(rows)
plots.save_table(summary, "06_drafts", NOTEBOOK, results_dir, sort_by=["model", "label"])
summary

# %% [markdown]
# ## Training curves: loss (rolling mean over 10 steps) and held-out agreement per TTT step

# %%
curves = pd.concat([pd.DataFrame(r.history).assign(model=n, label=l) for (n, l), r in runs.items()])
curves["loss_smooth"] = curves.groupby(["model", "label"])["loss"].transform(
    lambda s: s.rolling(10, min_periods=1).mean())
held_out = pd.concat([pd.read_csv(r.out_dir / "eval.csv").assign(model=n, label=l)
                      for (n, l), r in runs.items()])
held_out = held_out.melt(id_vars=["model", "label", "step"],
                         value_vars=[f"acc_{i}" for i in range(train_ttt_steps)],
                         var_name="ttt_step", value_name="top1_agreement")
for name in model_names:
    fig = plots.plot_training_curves(curves[curves["model"] == name],
                                     held_out[held_out["model"] == name],
                                     title=f"{name}: EAGLE-3 draft training per layer set")
    plots.save_figure(fig, f"06_training_curves_{model_zoo.slug(name)}", NOTEBOOK)
