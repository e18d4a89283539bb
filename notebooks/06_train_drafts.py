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
# capture store of notebook 01, with the training-time test unrolled `ttt_steps` steps and
# the loss Σ γ^i · soft-CE (`actwave.eagle3.train`). The target is never re-run: its soft
# labels come from the stored ℓ=N state through its final norm + LM head.
#
# Held-out top-1 agreement with the target (draft argmax == target argmax, per TTT step)
# is scored on the first `eval_sequences` sequences of the disjoint `analysis` store at
# every checkpoint. Drafts are cached under `<cache>/drafts/`, keyed by the training
# config and the store's hash, so a rerun skips finished drafts and resumes interrupted
# ones. `results/<profile>/06_drafts.json` maps model → label → draft folder (relative to
# the cache dir) for notebook 07.

# %% tags=["parameters"]
profile = "cpu"
models = "smollm2-135m,gemma3-270m"
train_models = "smollm2-135m"  # models that get drafts (notebook 01 captured their train split)
seed = 0
device = "cpu"
# the capture of notebook 01 (identifies its stores)
capture_dtype = "float32"
train_capture_dtype = "bfloat16"
train_source = "regenerated"
regen_new_tokens = 256
analysis_sequences = 64
train_sequences = 192
max_seq_len = 512
capture_batch_size = 4
# draft training; cpu defaults measured on SmolLM2: ~95 tok/s in bf16, ~10 min per draft
train_steps = 60
warmup_steps = 6
ttt_steps = 3
gamma = 0.8
lr = 1e-3
batch_size = 2
train_max_seq_len = 512
draft_vocab_size = 8192
lm_head_init = "random"
train_dtype = "bfloat16"
checkpoint_every = 15
eval_sequences = 8

# %%
import json
import logging

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from actwave import models as model_zoo
from actwave import plots
from actwave.config import artifact_dir, cache_dir, repo_root
from actwave.eagle3.train import TrainConfig, train_draft
from actwave.store import DTYPES, CaptureConfig, open_store

logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
logging.getLogger("actwave").setLevel(logging.INFO)
NOTEBOOK = "06_train_drafts"
model_names = [m.strip() for m in train_models.split(",") if m.strip()]
regen = {"regen_new_tokens": regen_new_tokens} if train_source == "regenerated" else {}
splits = {"train": (train_sequences, train_capture_dtype, {"source": train_source, **regen}),
          "analysis": (analysis_sequences, capture_dtype, {})}
captures = {(name, split): CaptureConfig(model=name, split=split, n_sequences=n,
                                         max_seq_len=max_seq_len, batch_size=capture_batch_size,
                                         dtype=dtype, seed=seed, **source)
            for name in model_names for split, (n, dtype, source) in splits.items()}
training = dict(ttt_steps=ttt_steps, gamma=gamma, lr=lr, warmup_steps=warmup_steps,
                total_steps=train_steps, batch_size=batch_size, max_seq_len=train_max_seq_len,
                draft_vocab_size=draft_vocab_size, seed=seed, checkpoint_every=checkpoint_every,
                dtype=train_dtype, eval_sequences=eval_sequences, lm_head_init=lm_head_init)
results_dir = repo_root() / "results" / profile
candidate_sets = json.loads((results_dir / "05_candidate_sets.json").read_text())
missing = [name for name in model_names if name not in candidate_sets]
assert not missing, f"05_candidate_sets.json has no layer sets for {missing}: run notebook 05"
plots.setup_style()
{name: candidate_sets[name] for name in model_names}

# %% [markdown]
# ## Training (one draft per distinct layer set; labels naming the same set share it)

# %%
runs, manifest = {}, {}
for name in model_names:
    target, _ = model_zoo.load(name, dtype=DTYPES["float32"], device=device)
    train_store = open_store(captures[name, "train"])
    eval_store = open_store(captures[name, "analysis"])
    for label, layers in sorted(candidate_sets[name].items()):
        config = TrainConfig(layer_ids=tuple(layers), **training)
        key = {"train": config, "model": name, "store": train_store.config_hash,
               "eval_store": eval_store.config_hash}
        label_layers = "-".join(map(str, layers))
        out_dir = artifact_dir("drafts", key, name=f"{model_zoo.slug(name)}-L{label_layers}")
        result = train_draft(train_store, target, config, out_dir, eval_store=eval_store)
        runs[name, label] = result
        manifest.setdefault(name, {})[label] = str(result.draft_dir.relative_to(cache_dir()))
        logging.info("%s %s %s: %.0f s", name, label, layers, result.seconds)
    del target
plots.save_json(manifest, "06_drafts", NOTEBOOK, results_dir)

# %% [markdown]
# ## Summary: final training loss and held-out top-1 agreement per TTT step
# `train_loss` = mean Σγ^i loss over the last 10% of steps; `acc_i` = held-out agreement at
# TTT step i (the draft's (i+1)-th token in a chain); `seconds` = wall time of training.

# %%
rows = []
for (name, label), result in runs.items():
    history = pd.DataFrame(result.history)
    tail = history.tail(max(1, len(history) // 10))
    rows.append({"model": name, "label": label, "layers": list(result.draft.layer_ids),
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
                         value_vars=[f"acc_{i}" for i in range(ttt_steps)],
                         var_name="ttt_step", value_name="top1_agreement")
for name in model_names:
    fig, axes = plt.subplots(1, 1 + ttt_steps, figsize=(3.6 * (1 + ttt_steps), 3.2), squeeze=False)
    sns.lineplot(data=curves[curves["model"] == name], x="step", y="loss_smooth", hue="label",
                 ax=axes[0][0], legend=False)
    axes[0][0].set(title="train loss Σ γ^i CE_i", ylabel="loss")
    for i in range(ttt_steps):
        subset = held_out[(held_out["model"] == name) & (held_out["ttt_step"] == f"acc_{i}")]
        sns.lineplot(data=subset, x="step", y="top1_agreement", hue="label", marker="o",
                     ax=axes[0][1 + i], legend=i == ttt_steps - 1)
        axes[0][1 + i].set(title=f"held-out top-1, TTT step {i}", ylim=(0, None))
    sns.move_legend(axes[0][-1], "upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(f"{name}: EAGLE-3 draft training per layer set")
    fig.tight_layout()
    plots.save_figure(fig, f"06_training_curves_{model_zoo.slug(name)}", NOTEBOOK)
