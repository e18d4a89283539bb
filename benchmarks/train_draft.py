"""The benchmark's draft: one EAGLE-3 draft trained with a few hours of this CPU.

The study's 1× drafts get 64 steps on 128 conversations, and their learning curves are still
rising there; a draft that is meant to *pay* in decoding gets the larger budget this script
spends, on the EAGLE-3 recipe: ShareGPT ``train``-split prompts whose replies the target
regenerated greedily (on-policy text), trained on the target's features computed once
(``actwave.eagle3.features``: the draft's layers and the target's argmax; a folder with them
is reused when present, e.g. the study long runs' with ``--pool train``). The text is the model's ``bench`` pool
(``profiles/data/pools.yaml``: nearly every ``train``-split conversation whose prompt fits, a
superset of the long runs' ``train`` pool's prompts): more fresh conversations rather than more
epochs over few.

Steps, each resumable (re-running the same command continues where it stopped):
1. regenerate the ``--pool`` and eval pools, or restore them from ``results/regenerated/`` (each
   chunk pinned there as it is written, so another machine regenerates only what is missing);
2. compute the target's features of both pools (``cache_dir()/features/<model>``), unless a
   folder with these layers is there;
3. train the draft into the draft cache, ``cache_dir()/drafts/<model>-L<layers>-s<seed>-<hash>/``
   (``actwave.index.draft_dir``; the hash keys the training config and the features'
   digest; checkpoints every ``--checkpoint-every`` steps) on the first ``--conversations``
   of that pool;
4. measure the draft's per-TTT-step top-1 agreement with the target on
   ``--eval-conversations`` training sequences and as many held-out eval-pool ones:
   overfitting shows as a gap;
5. write ``results/benchmarks/draft.json``: the configs, the folder (relative to the
   cache), the agreement, and the cost: regeneration seconds and tokens, training seconds
   and tokens.

``./reproduce.sh bench`` runs this, then ``benchmarks/run_all.py`` (which uses this draft).

    .venv/bin/python benchmarks/train_draft.py [--pool train --conversations 3200 --steps 3200]
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from actwave import index
from actwave.capture import models, pools, regenerate
from actwave.config import (atomic_write_json, config_hash, native_bf16, package_versions,
                            repo_root)
from actwave.eagle3.features import TargetFeatures, features_root, train_from_features
from actwave.eagle3.online import OnlineSource
from actwave.eagle3.train import TrainConfig, TrainData, evaluate_data
from actwave.stats.selection import eagle3_default
from actwave.study.longrun import LongRunConfig, features
from actwave.study.longtext import text_sources

OUT = repo_root() / "results/benchmarks"
CURVE_SEQUENCES = 100  # held-out sequences scored at every checkpoint (the learning curve)


@dataclass
class DraftBudget:
    """What the benchmark draft is trained on and for how long (saved in draft.json)."""

    model: str = models.DEFAULT_MODEL
    layers: str = ""               # comma-separated layer ids; "" = EAGLE-3's (2, N//2, N-3)
    pool: str = "bench"            # a pool of the model's (profiles/data/pools.yaml)
    conversations: int = 9216      # the first conversations of that pool
    max_seq_len: int = 320         # as the pool: prompt <= 160 tokens, reply <= 160
    steps: int = 9216              # 18,432 sequences: each seen twice
    warmup_steps: int = 32
    batch_size: int = 2
    ttt_steps: int = 3
    lr: float = 1e-3
    draft_vocab_size: int = 16384
    lm_head_init: str = "target"   # the target's output rows of the draft vocab (+0.02 step-0
                                   # agreement at 800 steps; docs/BENCHMARKS.md), or "random"
    dtype: str = "auto"            # training compute: "bfloat16" autocasts (weights stay fp32);
                                   # "auto": bf16 where native (docs/BENCHMARKS.md: learns as
                                   # fp32 does, 1.9x faster on an AVX-512-bf16 CPU), else fp32
    checkpoint_every: int = 768    # also the held-out curve's resolution
    seed: int = 0
    eval_conversations: int = 400  # held-out eval-pool conversations (+ as many train ones)

    def train(self, num_layers: int) -> TrainConfig:
        layer_ids = (tuple(int(x) for x in self.layers.split(",")) if self.layers.strip()
                     else eagle3_default(num_layers))
        return TrainConfig(layer_ids=layer_ids, ttt_steps=self.ttt_steps, lr=self.lr,
                           warmup_steps=self.warmup_steps, total_steps=self.steps,
                           batch_size=self.batch_size, max_seq_len=self.max_seq_len,
                           draft_vocab_size=self.draft_vocab_size,
                           lm_head_init=self.lm_head_init, seed=self.seed,
                           checkpoint_every=self.checkpoint_every,
                           dtype=self.compute_dtype(), eval_sequences=1)

    def compute_dtype(self) -> str:
        """``dtype`` with "auto" resolved for this machine (``native_bf16``)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if native_bf16() else "float32"


def training_cost(out_dir: Path) -> dict:
    """Steps, seconds and tokens of the run (history.csv: ``seconds`` is cumulative, resumes
    included)."""
    with open(out_dir / "history.csv") as handle:
        rows = list(csv.DictReader(handle))
    return {"train_steps": len(rows), "train_seconds": round(float(rows[-1]["seconds"]), 3),
            "train_tokens": int(sum(float(r["tokens"]) for r in rows))}


def pool_sources(budget: DraftBudget, target, tokenizer) -> dict[str, OnlineSource]:
    """{"train", "eval"}: the model's pools ``budget.pool`` and ``eval``, regenerated or
    restored (resumable, pinned chunk by chunk), tokenised; the first ``conversations`` /
    ``eval_conversations`` of each."""
    for name in ("eval", budget.pool):
        pools.pool(budget.model, name, target, tokenizer)
    return text_sources(budget.model, tokenizer, budget.max_seq_len, budget.conversations,
                        budget.eval_conversations, train_pool=budget.pool)


def _first(data: TrainData, n: int) -> TrainData:
    return TrainData(*(getattr(data, name)[:n] for name in TrainData.__dataclass_fields__))


def fit_and_held_out(budget: DraftBudget, train: TargetFeatures, held_out: TargetFeatures,
                     draft, target) -> dict:
    """Per-TTT-step top-1 agreement (``evaluate_data``) on the first ``eval_conversations``
    training sequences and on as many held-out eval-pool ones: a gap between the two is
    overfitting; held-out agreement far above the decoding acceptance would be a train/serve
    mismatch."""
    layers = draft.layer_ids
    n = min(budget.eval_conversations, len(train))
    return {name: evaluate_data(draft, data, target, ttt_steps=budget.ttt_steps)
            for name, data in (("train", _first(train.train_data(layers, budget.max_seq_len), n)),
                               ("held_out", held_out.train_data(layers, budget.max_seq_len)))}


def _curve(out_dir: Path) -> list[dict]:
    """Per checkpoint: step, tokens and held-out agreement per TTT step (``eval.csv``)."""
    with open(out_dir / "eval.csv") as handle:
        return [{k: float(v) for k, v in row.items() if k == "step" or k == "tokens"
                 or k.startswith("acc_")} for row in csv.DictReader(handle)]


def regeneration_cost(model: str, pool: str) -> dict:
    """Seconds and new tokens of the model's ``pool`` (all of it, not just what is used)."""
    folder = regenerate.output_dir(pools.pool_config(model, pool))
    manifest = json.loads((folder / "manifest.json").read_text())
    return {"regen_seconds": round(manifest["seconds"], 3),
            "regen_new_tokens": manifest["new_tokens"],
            "regen_conversations": manifest["n_conversations"]}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(DraftBudget()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--out", type=Path, default=OUT)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    budget = DraftBudget(**args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    target, tokenizer = models.load(budget.model)
    sources = pool_sources(budget, target, tokenizer)
    train = budget.train(models.num_layers(target))
    train_features, eval_features = features(LongRunConfig(model=budget.model), target,
                                             sources["train"], sources["eval"], train.layer_ids,
                                             features_root(budget.model))
    draft_dir = index.draft_dir(budget.model, train, config_hash(
        {"train": asdict(train), "data": train_features.digest}))
    curve = _first(eval_features.train_data(train.layer_ids, budget.max_seq_len), CURVE_SEQUENCES)
    result = train_from_features(train_features, target, train, draft_dir, eval_fn=lambda draft:
                                 evaluate_data(draft, curve, target, ttt_steps=budget.ttt_steps))
    agreement = fit_and_held_out(budget, train_features, eval_features, result.draft, target)
    atomic_write_json(out / "draft.json", {
        "agreement": agreement,
        "draft": index.cache_relative(draft_dir / "draft"), "budget": asdict(budget),
        "train_config": asdict(train), "sequences": len(sources["train"]),
        "sequence_tokens": sources["train"].n_tokens,
        **regeneration_cost(budget.model, budget.pool),
        "features": {"train": train_features.digest, "eval": eval_features.digest},
        "held_out_curve": _curve(draft_dir),
        **training_cost(draft_dir), "versions": package_versions()})
    return draft_dir


if __name__ == "__main__":
    main()
