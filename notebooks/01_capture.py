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

# %% tags=["parameters"]
profile = "cpu"
models = "smollm2-135m,gemma3-270m"
train_models = "smollm2-135m"      # models whose drafts are trained (notebook 06)
seed = 0
device = "cpu"
capture_dtype = "float32"          # analysis split: statistics in full precision
train_capture_dtype = "bfloat16"   # train split: draft inputs (stored in bf16 either way)
train_source = "regenerated"       # train replies: 'regenerated' by the target (EAGLE-3) | 'sharegpt'
regen_new_tokens = 256             # reply budget when regenerating
analysis_sequences = 64
train_sequences = 192
max_seq_len = 512
capture_batch_size = 4

# %%
import logging

import pandas as pd

from actwave import models as model_zoo
from actwave.config import repo_root
from actwave.plots import save_table
from actwave.store import DTYPES, CaptureConfig, run_capture

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
model_names = [m.strip() for m in models.split(",") if m.strip()]
trained = {m.strip() for m in train_models.split(",") if m.strip()}
sizes = {"analysis": analysis_sequences, "train": train_sequences}
dtypes = {"analysis": capture_dtype, "train": train_capture_dtype}
sources = {"analysis": "sharegpt", "train": train_source}
splits = {m: ["analysis", "train"] if m in trained else ["analysis"] for m in model_names}
# regen_new_tokens only where replies are regenerated: the analysis keys stay the defaults
# that notebooks 02-05 rebuild.
regen = {"analysis": {}, "train": {"regen_new_tokens": regen_new_tokens} if train_source == "regenerated" else {}}
configs = {(m, split): CaptureConfig(model=m, split=split, n_sequences=sizes[split],
                                     max_seq_len=max_seq_len, batch_size=capture_batch_size,
                                     dtype=dtypes[split], source=sources[split], seed=seed,
                                     **regen[split])
           for split in sizes for m in model_names if split in splits[m]}
results_dir = repo_root() / "results" / profile

# %%
rows = []
for name, split in configs:  # every analysis split first: notebooks 02-05 need only those
    model, tokenizer = model_zoo.load(name, dtype=DTYPES[dtypes[split]], device=device)
    store = run_capture(configs[name, split], model, tokenizer, device=device)
    m = store.manifest
    rows.append({"model": name, "split": split, "N": m["num_layers"], "d": m["hidden_size"],
                 "source": sources[split], "sequences": m["n_sequences"], "tokens": m["n_tokens"],
                 "assistant_tokens": int(store.column("loss_mask").sum()),
                 "dataset_hash": m["dataset_hash"], "store": store.path.name})
    logging.info("%s/%s: %d tokens in %.0f s", name, split, m["n_tokens"], m["seconds"])

# %%
summary = pd.DataFrame(rows)
save_table(summary, "01_capture", "01_capture", results_dir)
summary
