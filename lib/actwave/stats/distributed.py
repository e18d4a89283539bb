"""Layer statistics over many processes (``accelerate launch``): sums of token shards.

The streaming statistics (``layerstats.StreamingLayerStats``) are sums over tokens, so W
processes split the store and add their sums (docs/METHODS.md §5, README "Many GPUs"):

- Tokens are split by store shard (whole sequences): process r streams shards r, r+W,
  r+2W, ... The keep mask (entropy filter, special tokens, subsample) is computed by every
  process from the store's columns alone, so all agree on which tokens count.
- Every process shifts its tokens by the same reference, the mean of the first chunk a
  one-process pass would see (``first_chunk_reference``), so the sums of all processes
  share one origin; one all-reduce (SUM) of every accumulator and of the token counts
  then gives each process the sums over all tokens. The result equals the one-process
  pass up to the order of floating-point additions.
- Process 0 finalises and writes the cached artifact under the one-process key (it is the
  same statistic); the others wait for it and read it.

Launch: ``accelerate launch -m actwave.stats.distributed --store <capture dir> [options]``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from actwave.config import artifact_dir
from actwave.integrity import IntegrityError, WriterLock
from actwave.stats.analysis import (AnalysisConfig, _cache_key, check_memory, compute_layer_stats,
                                    load_layer_stats, save_layer_stats, token_keep_mask)
from actwave.stats.layerstats import CHUNK_TOKENS, LayerStats, StreamingLayerStats
from actwave.stats.metrics import unit_rows


def process_group() -> tuple[int, int]:
    """(rank, world size) of the initialised torch.distributed group, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_offsets(store) -> list[int]:
    """Token offset of every store shard, and the total at the end: (n_shards + 1) ints."""
    offsets = [0]
    for shard in store.manifest["shards"]:
        offsets.append(offsets[-1] + int(shard["n_tokens"]))
    return offsets


def _states(shard: dict, config: AnalysisConfig) -> torch.Tensor:
    return unit_rows(shard["hidden"]) if config.row_normalize else shard["hidden"]


def first_chunk_reference(store, keep: torch.Tensor, config: AnalysisConfig,
                          chunk_tokens: int) -> torch.Tensor:
    """(L, d) float64 mean of the first ``chunk_tokens`` kept tokens of the first shard
    holding any: the shift a one-process ``StreamingLayerStats`` takes from its first chunk."""
    offsets = shard_offsets(store)
    for index in range(len(offsets) - 1):
        kept = keep[offsets[index]: offsets[index + 1]]
        if kept.any():
            shard = next(store.iter_shards(columns=(), shard_ids=[index]))
            chunk = _states(shard, config)[:, kept][:, :chunk_tokens].to(torch.float64)
            return chunk.sum(dim=1) / chunk.shape[1]
    raise ValueError("no token of the store is kept; nothing to take a reference from")


def stream_shards(store, keep: torch.Tensor, config: AnalysisConfig, shard_ids: list[int],
                  reference: torch.Tensor, device) -> StreamingLayerStats:
    """Sums of the kept tokens of shards ``shard_ids`` around ``reference`` (L, d)."""
    offsets = shard_offsets(store)
    if offsets[-1] != keep.numel():
        raise ValueError(f"store shards hold {offsets[-1]} tokens but its columns {keep.numel()}")
    stream = StreamingLayerStats(store.num_layers + 1, store.hidden_size, device,
                                 matmul_dtype=getattr(torch, config.matmul_dtype),
                                 reference=reference)
    for index, shard in zip(shard_ids, store.iter_shards(columns=(), shard_ids=shard_ids)):
        stream.update(_states(shard, config), keep[offsets[index]: offsets[index + 1]])
    return stream


def all_reduce_sums(stream: StreamingLayerStats) -> None:
    """Add every process's accumulators and token counts in place (one SUM each)."""
    sums = stream.partial_sums()
    for tensor in sums:
        dist.all_reduce(tensor)
    counts = torch.tensor([stream.n_tokens, stream.n_seen], dtype=torch.int64,
                          device=sums[0].device)
    dist.all_reduce(counts)
    stream.n_tokens, stream.n_seen = (int(c) for c in counts.tolist())


def _has_cache(directory: Path, key: dict) -> bool:
    """Whether a verified artifact sits in ``directory`` (a failing one is dropped)."""
    if not (directory / "config.json").exists():
        return False
    try:
        load_layer_stats(directory, key)
        return True
    except IntegrityError:
        (directory / "config.json").unlink()
        return False


def layer_stats_all_processes(store, config: AnalysisConfig, device: str | torch.device = "cpu",
                              name: str | None = None) -> LayerStats:
    """``analysis.compute_layer_stats`` with the tokens split over the process group.

    Every process of the group calls it with the same arguments and gets the same cached
    ``LayerStats``; without a group (one process) it is ``compute_layer_stats``.
    """
    rank, world_size = process_group()
    if world_size == 1:
        return compute_layer_stats(store, config, device=device, progress=False, name=name)
    key = _cache_key(store, config)
    directory = artifact_dir("layer_stats", key, name or Path(store.path).name)
    with WriterLock(directory) if rank == 0 else contextlib.nullcontext():
        cached = [_has_cache(directory, key) if rank == 0 else None]
        dist.broadcast_object_list(cached, src=0)
        if not cached[0]:
            check_memory(store.num_layers + 1, store.hidden_size, device)
            keep, counts = token_keep_mask(store, config)
            if counts["n_used"] < 4:
                raise ValueError(f"only {counts['n_used']} tokens survive the filter {config}; "
                                 "need ≥ 4")
            n_shards = len(store.manifest["shards"])
            stream = stream_shards(store, keep, config, list(range(rank, n_shards, world_size)),
                                   first_chunk_reference(store, keep, config, CHUNK_TOKENS), device)
            all_reduce_sums(stream)
            if rank == 0:
                save_layer_stats(directory, stream.finalize(), key, seed=config.seed,
                                 token_counts=counts, processes=world_size)
        dist.barrier()
    return load_layer_stats(directory, key)


def main(argv: list[str] | None = None) -> None:
    """``accelerate launch -m actwave.stats.distributed --store DIR [--filter quantile
    --filter-value 0.5] [--max-tokens N] [--matmul-dtype float32]``: the cached layer
    statistics of a capture store, its tokens split over the launched processes."""
    import argparse

    from accelerate import Accelerator

    from actwave.capture.store import CaptureStore
    from actwave.stats.analysis import FILTERS, MATMUL_DTYPES

    parser = argparse.ArgumentParser(description="Layer statistics over many processes.")
    parser.add_argument("--store", required=True, help="a finished capture store folder")
    parser.add_argument("--filter", default="none", choices=FILTERS)
    parser.add_argument("--filter-value", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--matmul-dtype", default="float64", choices=MATMUL_DTYPES)
    args = parser.parse_args(argv)
    accelerator = Accelerator()
    config = AnalysisConfig(filter=args.filter, filter_value=args.filter_value,
                            max_tokens=args.max_tokens, matmul_dtype=args.matmul_dtype)
    stats = layer_stats_all_processes(CaptureStore(args.store), config, device=accelerator.device)
    if accelerator.is_main_process:
        print(f"{stats.n_tokens} tokens over {accelerator.num_processes} processes")
        for layer, entropy in zip(stats.layers, stats.entropy.tolist()):
            print(f"layer {layer:3d}  H1 {entropy:.6f} nats")


if __name__ == "__main__":
    main()
