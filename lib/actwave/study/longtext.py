"""The long runs' text: a model's pinned regenerated pools (``capture.pools``), or, for a
model without pools, ShareGPT's original replies of the same splits; each as an
``OnlineSource`` whose identity is the text's digest (part of every record's key).
"""
from __future__ import annotations

import json
from pathlib import Path

from actwave.config import config_hash
from actwave.eagle3.online import OnlineSource


def pool_digest(manifest: dict) -> str:
    """The identity of a regenerated pool: its config, model and every chunk's sha256 (the
    text itself, not the timing fields a restore rewrites)."""
    chunks = [(c["file"], c["sha256"]) for c in manifest["chunks"]]
    return config_hash({"config": manifest["config_hash"], "model": manifest["model_digest"],
                        "chunks": chunks})


def pool_source(regen, tokenizer, max_seq_len: int, pinned_dir: Path | None = None
                ) -> OnlineSource:
    """The tokenised sequences of a finished regeneration (``capture.regenerate``), restored
    from ``pinned_dir`` when given; identity ``pool-<pool_digest>``. Refuses an unfinished one
    (this never starts a regeneration)."""
    from actwave.capture import data as data_mod
    from actwave.capture import regenerate

    if pinned_dir is not None:
        regenerate.restore(regen, pinned_dir)
    folder = regenerate.output_dir(regen)
    manifest = json.loads((folder / "manifest.json").read_text()) if (
        folder / "manifest.json").exists() else {}
    if not manifest.get("complete") or not all((folder / c["file"]).is_file()
                                               for c in manifest["chunks"]):
        raise ValueError(f"regeneration {folder} is not finished; wait for it (or run "
                         "actwave.capture.regenerate.regenerate) first")
    rows = regenerate.regenerate(regen, progress=False)
    sequences = [data_mod.tokenize_chat(tokenizer, row["messages"], max_seq_len) for row in rows]
    sequences = [s for s in sequences if any(s["loss_mask"]) and len(s["input_ids"]) >= 3]
    return OnlineSource.from_sequences(sequences, f"pool-{pool_digest(manifest)}",
                                       f"regenerated:{folder.name}")


def sharegpt_source(model: str, split: str, n: int, tokenizer, max_seq_len: int) -> OnlineSource:
    """The first ``n`` usable conversations of a ShareGPT split with their *original*
    replies (for a target whose own greedy replies degenerate, e.g. the Gemma-3 base
    model: docs/METHODS.md §3); identity ``sharegpt-<hash of the text and settings>``."""
    from actwave.capture import data as data_mod

    rows = data_mod.sharegpt_split(split)
    sequences, used = [], []
    for index, row in enumerate(rows):
        sequence = data_mod.tokenize_chat(tokenizer, row["messages"], max_seq_len)
        if any(sequence["loss_mask"]) and len(sequence["input_ids"]) >= 3:
            sequences.append(sequence)
            used.append(index)
        if len(sequences) == n:
            break
    identity = config_hash({"model": model, "split": split, "n": n, "max_seq_len": max_seq_len,
                            "data": data_mod.content_hash(rows.select(used))})
    return OnlineSource.from_sequences(sequences, f"sharegpt-{identity}", f"sharegpt:{split}")


def text_sources(model: str, tokenizer, max_seq_len: int, n_train: int, n_eval: int,
                 train_pool: str = "train") -> dict[str, OnlineSource]:
    """{"train", "eval"}: the model's regenerated pools ``train_pool`` and ``eval``
    (``capture.pools``; the first n of each) when it has them, else ShareGPT's original
    replies of the train and eval splits."""
    from actwave.capture import pools

    if model not in pools.pool_configs():
        return {split: sharegpt_source(model, split, n, tokenizer, max_seq_len)
                for split, n in (("train", n_train), ("eval", n_eval))}
    sources = {}
    for split, name, n in (("train", train_pool, n_train), ("eval", "eval", n_eval)):
        source = pool_source(pools.pool_config(model, name), tokenizer, max_seq_len,
                             pools.pinned_dir())
        sources[split] = OnlineSource(source.input_ids[:n], source.loss_mask[:n],
                                      f"{source.config_hash}-first{n}", source.path)
    return sources
