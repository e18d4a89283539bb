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
# # 01 — Capture hidden states
#
# One pass of each target over ShareGPT stores, per token, all N+1 hidden states (ℓ = number
# of decoder blocks applied; ℓ=N before the final norm), the target's predictive entropy and
# argmax. Two disjoint splits: `analysis` (entropy/CKA statistics, notebooks 02–05) and
# `train` (EAGLE-3 drafts, notebook 06). Every later notebook reads these stores; none
# re-runs the target. Interrupted captures resume at the first missing shard.
# `results/<profile>/01_stores.json` indexes the stores (model → split → folder under the
# cache dir, and its config; a run for some models keeps the others'): later notebooks
# open them from there.

# %% tags=["parameters"]
profile = "cpu"
models = "smollm2-135m,gemma3-270m"
train_models = "smollm2-135m"      # models whose drafts are trained (notebook 06)
seed = 0
device = "cpu"
# the analysis split of every model (CaptureConfig): statistics in full precision
capture_n_sequences = 64
capture_max_seq_len = 512
capture_batch_size = 4
capture_dtype = "float32"
# the train split of train_models (CaptureConfig): draft inputs (stored in bf16 either way)
train_capture_n_sequences = 96
train_capture_max_seq_len = 512
train_capture_batch_size = 4
train_capture_dtype = "float32"
train_capture_source = "sharegpt"  # replies: 'sharegpt' (original) | 'regenerated' by the target (EAGLE-3)
train_capture_regen_new_tokens = 256  # reply budget when regenerating

# %%
import pandas as pd

from actwave import index
from actwave.capture import models as model_zoo
from actwave.capture.store import DTYPES, run_capture
from actwave.notebook import notebook_setup
from actwave.plots import save_json, save_table

NOTEBOOK, model_names, results_dir, log = notebook_setup("01_capture", profile, models)
configs = index.capture_configs(models, train_models, globals())
configs

# %%
rows = []
for (name, split), config in configs.items():  # analysis splits first: 02-05 need only those
    model, tokenizer = model_zoo.load(name, dtype=DTYPES[config.dtype], device=device)
    store = run_capture(config, model, tokenizer, device=device)
    m = store.manifest
    rows.append({"model": name, "split": split, "N": m["num_layers"], "d": m["hidden_size"],
                 "source": config.source, "sequences": m["n_sequences"], "tokens": m["n_tokens"],
                 "assistant_tokens": int(store.column("loss_mask").sum()),
                 "dataset_hash": m["dataset_hash"], "store": store.path.name})
    log.info("%s/%s: %d tokens in %.0f s", name, split, m["n_tokens"], m["seconds"])

# %%
summary = pd.DataFrame(rows)
save_table(summary, "01_capture", NOTEBOOK, results_dir)
# The index later notebooks open the stores by (model, split → folder under the cache dir).
save_json(index.stores_index(configs, index.read_whole_index(results_dir, index.STORES)),
          index.STORES, NOTEBOOK, results_dir)
summary
