"""The benchmark's draft: one EAGLE-3 draft trained with about an hour of this CPU.

The study's drafts get 64 (curve: 256) steps on 128 conversations, and their learning
curves are still rising there (results/study/10_learning_curve_*.csv); a draft that is
meant to *pay* in decoding gets the larger budget this script spends, on the EAGLE-3
recipe: ShareGPT ``train``-split prompts whose replies the target regenerated greedily
(on-policy text), trained online (the target runs inside the training loop, so no
multi-GB hidden-state store is written; ``actwave.eagle3.online``).

Steps, each resumable (re-running the same command continues where it stopped):
1. regenerate the replies, or restore them from the copy pinned under
   ``results/benchmarks/regenerated/`` (so another machine skips the regeneration);
2. train the draft into ``cache_dir()/bench-drafts/<hash>/`` (checkpoints every
   ``--checkpoint-every`` steps);
3. measure the draft's per-TTT-step top-1 agreement with the target on
   ``--eval-conversations`` training sequences and as many held-out eval-split ones
   (replies regenerated and pinned the same way): overfitting shows as a gap;
4. write ``results/benchmarks/draft.json``: the configs, the folder (relative to the
   cache), the agreement, and the cost: regeneration seconds and tokens, training seconds
   and tokens.

``benchmarks/run_all.py`` uses this draft when its folder is in the cache.

    .venv/bin/python benchmarks/train_draft.py [--conversations 768 --steps 1600]
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from actwave.capture import models, regenerate
from actwave.capture.store import CaptureConfig, regen_config
from actwave.config import (atomic_write_json, cache_dir, config_hash, package_versions,
                            repo_root)
from actwave.eagle3.online import OnlineSource, evaluate_online, online_source, train_online
from actwave.eagle3.train import TrainConfig
from actwave.stats.selection import eagle3_default

OUT = repo_root() / "results/benchmarks"


@dataclass
class DraftBudget:
    """What the benchmark draft is trained on and for how long (saved in draft.json)."""

    model: str = models.DEFAULT_MODEL
    layers: str = ""               # comma-separated layer ids; "" = EAGLE-3's (2, N//2, N-3)
    conversations: int = 768       # regenerated train-split conversations
    max_seq_len: int = 320         # as the study: prompt <= 160 tokens, reply <= 160
    regen_new_tokens: int = 160
    steps: int = 1600
    warmup_steps: int = 32
    batch_size: int = 2
    ttt_steps: int = 3
    lr: float = 1e-3
    draft_vocab_size: int = 16384
    checkpoint_every: int = 100
    seed: int = 0
    eval_conversations: int = 48   # regenerated eval-split conversations (held out) + as many train

    def capture(self, split: str = "train") -> CaptureConfig:
        n_sequences = self.conversations if split == "train" else self.eval_conversations
        return CaptureConfig(model=self.model, split=split, n_sequences=n_sequences,
                             max_seq_len=self.max_seq_len, dtype="float32",
                             source="regenerated", regen_new_tokens=self.regen_new_tokens,
                             seed=self.seed)

    def train(self, num_layers: int) -> TrainConfig:
        layer_ids = (tuple(int(x) for x in self.layers.split(",")) if self.layers.strip()
                     else eagle3_default(num_layers))
        return TrainConfig(layer_ids=layer_ids, ttt_steps=self.ttt_steps, lr=self.lr,
                           warmup_steps=self.warmup_steps, total_steps=self.steps,
                           batch_size=self.batch_size, max_seq_len=self.max_seq_len,
                           draft_vocab_size=self.draft_vocab_size, seed=self.seed,
                           checkpoint_every=self.checkpoint_every, dtype="float32",
                           eval_sequences=1)


def training_cost(out_dir: Path) -> dict:
    """Steps, seconds and tokens of the run (history.csv: ``seconds`` is cumulative, resumes
    included)."""
    with open(out_dir / "history.csv") as handle:
        rows = list(csv.DictReader(handle))
    return {"train_steps": len(rows), "train_seconds": round(float(rows[-1]["seconds"]), 3),
            "train_tokens": int(sum(float(r["tokens"]) for r in rows))}


def regenerated_source(capture: CaptureConfig, target, tokenizer, pinned: Path) -> OnlineSource:
    """The split's sequences with regenerated replies: restored from the pin, else
    regenerated (resumable) and pinned."""
    regenerate.restore(regen_config(capture), pinned)
    source = online_source(capture, target, tokenizer)  # regenerates unless cached
    regenerate.pin(regen_config(capture), pinned)
    return source


def fit_and_held_out(budget: DraftBudget, source: OnlineSource, draft, target, tokenizer,
                     pinned: Path) -> dict:
    """Per-TTT-step top-1 agreement (``evaluate_online``) on the first
    ``eval_conversations`` training sequences and on as many held-out eval-split ones
    (replies regenerated the same way): a gap between the two is overfitting; held-out
    agreement far above the decoding acceptance would be a train/serve mismatch."""
    held_out = regenerated_source(budget.capture("eval"), target, tokenizer, pinned)
    n = min(budget.eval_conversations, len(source))
    seen = OnlineSource(source.input_ids[:n], source.loss_mask[:n], source.config_hash, source.path)
    return {name: evaluate_online(draft, data.truncated(budget.max_seq_len), target,
                                  ttt_steps=budget.ttt_steps)
            for name, data in (("train", seen), ("held_out", held_out))}


def regeneration_cost(capture: CaptureConfig) -> dict:
    manifest = json.loads((regenerate.output_dir(regen_config(capture)) / "manifest.json")
                          .read_text())
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
    capture = budget.capture()
    pinned = out / "regenerated"
    source = regenerated_source(capture, target, tokenizer, pinned)
    train = budget.train(models.num_layers(target))
    draft_dir = cache_dir() / "bench-drafts" / config_hash({"train": asdict(train),
                                                             "data": source.config_hash})
    result = train_online(source, target, train, draft_dir)
    agreement = fit_and_held_out(budget, source, result.draft, target, tokenizer, pinned)
    atomic_write_json(out / "draft.json", {
        "agreement": agreement,
        "draft": str((draft_dir / "draft").relative_to(cache_dir())), "budget": asdict(budget),
        "train_config": asdict(train), "sequences": len(source),
        "sequence_tokens": source.n_tokens, **regeneration_cost(capture),
        **training_cost(draft_dir), "versions": package_versions()})
    return draft_dir


if __name__ == "__main__":
    main()
