"""The long runs' trained drafts decoded (issue 21, item 5): one draft at a time, on the
machine that trained it.

A draft lives only in the cache of the machine that trained it (58 MB, not committed),
and the six sets' drafts of one seed take several sessions on a small CPU, which may land
on different machines. So each draft of the decoding seed at the largest budget is decoded
on its own as soon as it is trained (``actwave longrun`` does it after the job, notebook 12
for any such draft on its machine that is not decoded yet), and its tables are committed:

    results/study/long/<model>/decoding/<label>-s<seed>-b<budget>-<key>/
        machine.json  summary.csv  walk.csv  (and evaluate's per-prompt records, which resume)

Each run is one ``fastpath.compare`` with this one draft: the chain of depth ``ttt_steps``
and the auto shape (this draft's reach, this machine's cost curve), each timed against our
routed greedy on the same prompts in the same run, so a speedup never compares two
machines; and ``acceptance.walk_check``: the offline walk over each chain record's greedy
text equals its decoding τ. ``decoded_tables`` gathers the runs of one seed and budget.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from actwave.config import atomic_write_bytes, atomic_write_json, machine

log = logging.getLogger(__name__)
TABLES = ("summary", "walk")


def _job_key(record: dict) -> str:
    """``<label>-s<seed>-b<budget>-<record key>``: one job's folder name."""
    return f"{record['label']}-s{record['seed']}-b{record['budget']}-{record['key']}"


def branch_draft_dir(record: dict, work_dir: Path) -> Path:
    """Where the job of ``record`` left the draft it scored (``work_dir/branches``)."""
    return Path(work_dir) / "branches" / _job_key(record) / "draft"


def branch_draft(record: dict, target, work_dir: Path):
    """The draft a record scored, from the cache (``work_dir/branches``), refused unless its
    weights are the record's (``draft_fingerprint``); FileNotFoundError when this machine
    does not hold it (rerun the job after deleting the record to retrain it)."""
    from actwave.eagle3 import Eagle3Draft

    folder = branch_draft_dir(record, work_dir)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no draft of record {record['label']} seed {record['seed']} "
                                f"budget {record['budget']} at {folder}")
    draft = Eagle3Draft.load(folder, target)
    if draft.fingerprint() != record["draft_fingerprint"]:
        raise ValueError(f"the draft at {folder} has weights {draft.fingerprint()}, the record "
                         f"scored {record['draft_fingerprint']}")
    return draft


def decoding_config(values: Mapping[str, Any], model: str, depth: int):
    """The check's ``EvalConfig`` from a profile's flat parameters (the eval section's dtype,
    benchmarks and turns; ``longrun_decode_*``): the chain of ``depth`` (the drafts'
    ttt_steps), no peers. One place for notebook 12 and ``actwave longrun``."""
    from actwave.profile import build

    return build("eval", values, model=model, n_prompts=values["longrun_decode_prompts"],
                 max_new_tokens=values["longrun_decode_new_tokens"],
                 max_prompt_tokens=values["longrun_decode_max_prompt_tokens"], mode="chain",
                 depth=depth, peers=False)


def run_dir(folder: Path, record: dict) -> Path:
    """``folder/decoding/<label>-s<seed>-b<budget>-<record key>``: one draft's run."""
    return Path(folder) / "decoding" / _job_key(record)


def is_decoded(folder: Path, record: dict) -> bool:
    return all((run_dir(folder, record) / f"{table}.csv").is_file() for table in TABLES)


def due(records: list[dict], budget: int, seed: int, folder: Path, work_dir: Path) -> list[dict]:
    """The records of ``seed`` at ``budget`` whose draft is on this machine and not decoded."""
    return [r for r in records if r["budget"] == budget and r["seed"] == seed
            and not is_decoded(folder, r)
            and (branch_draft_dir(r, work_dir) / "config.json").exists()]


def decode_draft(model: str, record: dict, eval_config, routes: str, acceptance_prompts: int,
                 folder: Path, work_dir: Path) -> dict[str, pd.DataFrame]:
    """Decode one record's draft (``fastpath.compare``: chain and auto shape, under
    ``routes``) and check the walk; write ``machine.json`` (host, CPU, threads, load average
    at the start and the end: was another job running beside it?), ``summary.csv`` and
    ``walk.csv`` into its ``run_dir`` (the walk last: its presence marks the run done).
    -> {"summary", "walk"}, each with the draft's label, seed and budget as ``draft_*``
    columns."""
    from actwave.capture.models import DTYPES, load, stop_token_ids
    from actwave.decoding import acceptance, fastpath

    target, tokenizer = load(model, dtype=DTYPES[eval_config.dtype])
    where = machine(str(next(target.parameters()).device))
    dtype = next(target.parameters()).dtype
    label = record["label"]
    drafts = {label: branch_draft(record, target, work_dir).to(dtype).eval()}
    out = run_dir(folder, record)
    comparison = fastpath.compare(target, tokenizer, drafts, eval_config,
                                  stop_token_ids(tokenizer, model), routes=routes,
                                  acceptance_prompts=acceptance_prompts, out_dir=out,
                                  run_name="decode")
    walk = acceptance.walk_check(target, drafts, comparison.runs["fixed"]["records"],
                                 eval_config.depth)
    tables = {"summary": comparison.summary(), "walk": walk}
    tagged = {name: table.assign(draft_label=label, draft_seed=record["seed"],
                                 draft_budget=record["budget"]) for name, table in tables.items()}
    atomic_write_json(out / "machine.json", {**where, "load_average_end": os.getloadavg()[0]})
    for name in TABLES:
        atomic_write_bytes(out / f"{name}.csv", tagged[name].to_csv(index=False).encode())
    return tagged


def decode_due(model: str, records: list[dict], budget: int, seed: int, values, depth: int,
               folder: Path, work_dir: Path) -> list[str]:
    """``decode_draft`` for every ``due`` record, with the profile's settings (``values``:
    flat parameters, ``routes``, ``acceptance_prompts``, ``longrun_decode_*``). -> the
    decoded labels."""
    config = decoding_config(values, model, depth)
    done = []
    for record in due(records, budget, seed, folder, work_dir):
        log.info("decoding %s seed %s at %s steps", record["label"], seed, budget)
        decode_draft(model, record, config, values["routes"], values["acceptance_prompts"],
                     folder, work_dir)
        done.append(record["label"])
    return done


def decoded_tables(folder: Path, records: list[dict], labels, budget: int,
                   seed: int) -> dict[str, pd.DataFrame] | None:
    """The committed runs of ``seed``'s drafts of ``labels`` at ``budget`` (current records'
    keys only), concatenated: {"summary", "walk"}; None when none is decoded."""
    chosen = [r for r in records if r["budget"] == budget and r["seed"] == seed
              and r["label"] in set(labels) and is_decoded(folder, r)]
    if not chosen:
        return None
    return {name: pd.concat([pd.read_csv(run_dir(folder, r) / f"{name}.csv") for r in chosen],
                            ignore_index=True) for name in TABLES}
