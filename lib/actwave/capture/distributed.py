"""Capture over many processes (``accelerate launch``): whole shards each, one manifest writer.

The store is the one ``store.run_capture`` writes (docs/METHODS.md §3, README "Many GPUs"):

- Every process loads its own copy of the target and tokenizes the split. The shards still
  to capture (all of them, or those a resumed or repaired store lacks) go round-robin:
  process r captures the pending shards r, r + W, r + 2W, ... (on a new store: shards r,
  r + W, ...). A shard is whole sequences, so each process writes only its own shard files
  (temp file + rename).
- Process 0 alone holds the store's ``WriterLock`` and writes the manifest. It reads and
  re-verifies the manifest, makes a new one if there is none, and (``source="regenerated"``)
  regenerates the replies before the others tokenize; the others check their model and data
  against its manifest (model fingerprint, data hash).
- Shards are captured in rounds of W, one per process; after each round every process's
  shard records (file, tokens, sequences, checksums) are gathered and process 0 rewrites
  the manifest, so an interrupted run loses at most its last round.
- A process whose work fails sends its error instead of a result; every process then
  raises (process 0 first records the shards that did finish), so none waits forever.

Launch: ``accelerate launch -m actwave.capture.distributed --model M --split S [--<field> V]``
with one ``--<field>`` per ``CaptureConfig`` field.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import fields
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from actwave.capture.store import (CaptureConfig, CaptureStore, capture_shard, mark_complete,
                                   pending_shards, prepare_capture, record_shards, run_capture,
                                   store_dir, verified_manifest)
from actwave.integrity import WriterLock
from actwave.stats.distributed import process_group


def shards_of_process(pending: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The shard numbers process ``rank`` of ``world_size`` captures: pending[rank::W]."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; allowed: an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}; allowed: an int in 0..{world_size - 1} "
                         f"(world_size={world_size})")
    return list(pending[rank::world_size])


def gather_outcomes(work: Callable[[], object]) -> tuple[list[tuple], Exception | None]:
    """Run ``work`` here and gather every process's outcome, in rank order:
    (result, None) or (None, error text). -> (outcomes, this process's own error).

    A failing ``work`` still joins the gather, so no other process is left waiting."""
    error = None
    try:
        mine = (work(), None)
    except Exception as err:  # any failure: it is re-raised by raise_failures
        error, mine = err, (None, f"{type(err).__name__}: {err}")
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    return outcomes, error


def raise_failures(outcomes: list[tuple], error: Exception | None) -> None:
    """Re-raise this process's error, else name the first process that failed."""
    if error is not None:
        raise error
    for rank, (_, text) in enumerate(outcomes):
        if text is not None:
            raise RuntimeError(f"capture process {rank} failed: {text} (the shards already "
                               "in the manifest are kept; a rerun resumes after them)")


def on_every_process(work: Callable[[], object]) -> list:
    """Every process's result of ``work``, in rank order; raises if any process failed."""
    outcomes, error = gather_outcomes(work)
    raise_failures(outcomes, error)
    return [result for result, _ in outcomes]


def _capture_rounds(config: CaptureConfig, model, tokenizer, sequences: list[dict],
                    manifest: dict, out, progress: bool) -> None:
    """Capture the pending shards, one per process per round; process 0 records each round."""
    rank, world_size = process_group()
    pending = pending_shards(manifest, config, len(sequences))
    mine = shards_of_process(pending, rank, world_size)
    n_rounds = len(range(0, len(pending), world_size))
    for round_no in tqdm(range(n_rounds), desc=f"capture {config.model}/{config.split}",
                         disable=not progress or rank != 0, mininterval=10):
        tic = time.perf_counter()
        outcomes, error = gather_outcomes(
            lambda: capture_shard(config, model, tokenizer, sequences, mine[round_no], out)
            if round_no < len(mine) else None)
        if rank == 0:
            finished = [record for record, _ in outcomes if record is not None]
            record_shards(manifest, finished, time.perf_counter() - tic, out)
        raise_failures(outcomes, error)


def _agree_on_manifest(config: CaptureConfig, model, tokenizer, out, device) -> tuple[dict, list]:
    """Process 0 (holding the lock) re-verifies the manifest, or makes one, and regenerates
    replies if needed; then the others check their model and data against it.
    -> (the manifest, this process's [model, tokenizer, sequences]; empty if complete)."""
    rank, _ = process_group()
    prepared = []  # this process's model, tokenizer and sequences, once checked

    def prepare(manifest: dict | None) -> dict:
        *loaded, manifest = prepare_capture(config, model, tokenizer, manifest, out, device)
        prepared.extend(loaded)
        return manifest

    def process_0() -> dict:
        manifest = verified_manifest(config, model, out)
        return manifest if manifest is not None and manifest["complete"] else prepare(manifest)

    def the_others() -> None:
        if rank != 0:
            prepare(manifest)

    manifest = on_every_process(process_0 if rank == 0 else lambda: None)[0]
    if not manifest["complete"]:
        on_every_process(the_others)
    return manifest, prepared


def capture_all_processes(config: CaptureConfig, model=None, tokenizer=None,
                          progress: bool = True, device: str | torch.device = "cpu"
                          ) -> CaptureStore:
    """``store.run_capture`` with the shards split over the process group.

    Every process calls it with the same config (and the same model, if one is passed) and
    gets the finished store; without a group (one process) it is ``run_capture``.
    """
    rank, world_size = process_group()
    if world_size == 1:
        return run_capture(config, model, tokenizer, progress, device)
    out = store_dir(config)
    with WriterLock(out) if rank == 0 else contextlib.nullcontext():
        manifest, prepared = _agree_on_manifest(config, model, tokenizer, out, device)
        if not manifest["complete"]:
            _capture_rounds(config, *prepared, manifest, out, progress)
            # Also the barrier after which the others open the finished store.
            on_every_process(lambda: mark_complete(manifest, out) if rank == 0 else None)
    return CaptureStore(out)


def main(argv: list[str] | None = None) -> None:
    """``accelerate launch -m actwave.capture.distributed --model M [--split analysis]
    [--n_sequences 64] [--max_seq_len 512] [--<CaptureConfig field> V ...]``: the capture
    store of a split, its shards split over the launched processes."""
    import argparse

    from accelerate import Accelerator

    parser = argparse.ArgumentParser(description="Capture a split over many processes.")
    parser.add_argument("--model", required=True, help="bundled name, HF id or local path")
    for f in fields(CaptureConfig):
        if f.name != "model":
            parser.add_argument(f"--{f.name}", type=type(f.default), default=None)
    args = parser.parse_args(argv)
    config = CaptureConfig(**{f.name: getattr(args, f.name) for f in fields(CaptureConfig)
                              if getattr(args, f.name) is not None})
    store = capture_all_processes(config, device=Accelerator().device)
    rank, world_size = process_group()
    if rank == 0:
        print(f"{store.n_tokens} tokens in {len(store.manifest['shards'])} shards over "
              f"{world_size} processes: {store.path}")


if __name__ == "__main__":
    main()
