"""Pools of regenerated text (``profiles/data/pools.yaml``), shared by every stage that trains or
scores drafts on on-policy text.

A pool is one named ``RegenConfig`` per model (its ShareGPT split is its ``split`` field, else
its name: ``train``, ``eval``), regenerated once, pinned chunk by chunk under
``results/regenerated/`` (``regenerate.pin``) and restored from there on another machine.
Stages that need fewer conversations take the pool's first ones.

    python -m actwave.capture.pools --model smollm2-135m [--pool train]
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import yaml
from datasets import Dataset

from actwave.capture.regenerate import RegenConfig, regenerate
from actwave.config import repo_root

POOLS_FILE = "profiles/data/pools.yaml"
PINNED_DIR = "results/regenerated"


def pools_file() -> Path:
    """``$ACTWAVE_POOLS`` (a YAML file of the same layout: pools of your own models), else
    the repository's ``profiles/data/pools.yaml``."""
    return Path(os.environ.get("ACTWAVE_POOLS") or repo_root() / POOLS_FILE)


def pool_configs() -> dict[str, dict[str, RegenConfig]]:
    """{model: {pool name: RegenConfig}} as the pools file declares them; a pool without a
    ``split`` field regenerates the ShareGPT split of its name."""
    path = pools_file()
    declared = yaml.safe_load(path.read_text()) or {}
    return {model: {name: RegenConfig(model=model, **({"split": name} | fields))
                    for name, fields in named.items()}
            for model, named in declared.items()}


def pool_config(model: str, name: str) -> RegenConfig:
    """The pool ``name`` of ``model``; a model or pool not declared is refused by name."""
    pools = pool_configs()
    if model not in pools:
        raise ValueError(f"no regenerated-text pool for model {model!r} in {pools_file()}; "
                         f"pools exist for {sorted(pools)}")
    if name not in pools[model]:
        raise ValueError(f"no {name!r} pool for {model!r} in {pools_file()}; it has "
                         f"{sorted(pools[model])}")
    return pools[model][name]


def pinned_dir() -> Path:
    """Where pools are pinned: ``$ACTWAVE_PINNED``, else ``results/regenerated``."""
    return Path(os.environ.get("ACTWAVE_PINNED") or repo_root() / PINNED_DIR)


def pool(model: str, name: str, target=None, tokenizer=None, progress: bool = True) -> Dataset:
    """The pool's conversations: restored from the pin, regenerated where it lacks chunks
    (each new chunk pinned at once). Pass a loaded target/tokenizer to reuse them."""
    return regenerate(pool_config(model, name), target, tokenizer, progress=progress,
                      pinned_dir=pinned_dir())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="regenerate (or restore) text pools")
    parser.add_argument("--model", required=True, help="a model with pools in " + POOLS_FILE)
    parser.add_argument("--pool", action="append", help="only these pools (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # eval first: it is small, and scoring needs it before long training runs finish
    names = args.pool or sorted(pool_configs().get(args.model, {}), key=lambda s: s != "eval")
    if not names:
        pool_config(args.model, "train")  # raises, naming the models that have pools
    for name in names:
        print(f"{args.model}/{name}: {len(pool(args.model, name))} conversations", flush=True)


if __name__ == "__main__":
    main()
