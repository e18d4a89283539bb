"""Layer statistics of a capture store: token filtering, one streaming pass, cached result.

Reads the hidden states a capture pass stored (``actwave.capture.store.CaptureStore``), decides
which tokens to keep from the per-token columns alone (a cheap pre-pass: predictive-entropy
filter, special tokens, loss mask, optional seeded subsample), then makes one pass over the
shards with ``layerstats.StreamingLayerStats``. The result is cached under
``cache_dir()/layer_stats/<name>-<hash>/``, the hash keyed by the store's content digest
(``CaptureStore.digest``: its shard records and model) and the ``AnalysisConfig``, so a
recaptured store with other contents never reuses old statistics: ``stats.safetensors``
(tensors), ``stats.json`` (the rest of ``LayerStats``) and ``config.json`` (config, filter
counts, versions, both files' size and sha256, its own checksum; written last, so its
presence marks a complete artifact).
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from actwave.config import artifact_dir, to_jsonable
from actwave.integrity import (Between, IntegrityError, WriterLock, check_fields, file_record,
                               read_record, save_config_record, verify_once,
                               write_record)
from actwave.stats.blockstats import block_pair_layer_stats
from actwave.stats.layerstats import LayerStats, StreamingLayerStats
from actwave.stats.metrics import token_filter, unit_rows

log = logging.getLogger(__name__)
FILTERS = ("none", "quantile", "threshold")
MATMUL_DTYPES = ("float64", "float32")
# How the pair statistics are accumulated (equal results; not part of the cache key):
# 'all_pairs' keeps every d×d cross block (needed by aggregate Shannon entropies),
# 'block_pairs' a budgeted few at a time over several passes (actwave.stats.blockstats).
ROUTES = ("all_pairs", "block_pairs")
# Fields added to AnalysisConfig after artifacts were cached, with their defaults.
LATER_FIELDS = {"row_normalize": False}


@dataclass
class AnalysisConfig:
    """Which tokens enter the layer statistics.

    ``filter``: 'none' | 'quantile' (keep predictive entropy ≥ the ``filter_value``-quantile
    of the candidate tokens, e.g. 0.5 keeps the top half) | 'threshold' (keep entropy ≥
    ``filter_value`` nats). Candidates exclude special tokens (``exclude_special``) and,
    with ``only_loss_mask``, tokens outside assistant replies. ``max_tokens``: keep a
    uniform random subset of that size (``seed``) of the filtered tokens.
    ``matmul_dtype``: precision of the per-chunk cross products in ``StreamingLayerStats``
    ('float32' is ≈2× faster on CPU, relative error ~1e-6; sums stay float64).
    ``row_normalize``: scale each token's state at each layer to unit L2 norm before the
    statistics (``metrics.unit_rows``), the variant Skean et al. 2025 use.
    """

    filter: str = "none"
    filter_value: float = 0.0
    exclude_special: bool = True
    only_loss_mask: bool = False
    max_tokens: int | None = None
    seed: int = 0
    matmul_dtype: str = "float64"
    row_normalize: bool = False

    def __post_init__(self) -> None:
        check_fields(self, {"seed": Between(0)})
        if self.filter not in FILTERS:
            raise ValueError(f"filter must be one of {FILTERS}, got {self.filter!r}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, "
                             f"got {self.matmul_dtype!r}")
        if self.filter == "quantile" and not 0.0 <= self.filter_value < 1.0:
            raise ValueError(f"quantile filter_value must be in [0, 1), got {self.filter_value}")
        if self.max_tokens is not None and self.max_tokens < 4:
            raise ValueError(f"max_tokens must be None or ≥ 4, got {self.max_tokens}")
        if not isinstance(self.row_normalize, bool):
            raise ValueError(f"row_normalize must be True or False, got {self.row_normalize!r}")

    def key(self) -> dict:
        """The config as the cache key sees it: fields added after the first release
        (``LATER_FIELDS``) only when they differ from their default, so every artifact cached
        before they existed keeps its key."""
        record = to_jsonable(self)
        for name, default in LATER_FIELDS.items():
            if record[name] == default:
                del record[name]
        return record


def token_settings(filter_quantile: float, max_tokens: int | None = None, seed: int = 0,
                   with_special: bool = False,
                   matmul_dtype: str = "float64") -> dict[str, AnalysisConfig]:
    """The token sets the analysis notebooks compare, by table label, in this order.

    "all tokens": every non-special token; "top X% entropy" (X = 1 − ``filter_quantile``):
    predictive entropy ≥ that quantile, the hard tokens that decide acceptance;
    ``with_special`` adds "all + special" (special tokens kept) to show the effect of
    massive activations once (docs/METHODS.md §6). ``max_tokens`` 0 or None: every kept
    token (0 is how a profile, which holds scalars, says it).
    """
    common = {"max_tokens": max_tokens or None, "seed": seed, "matmul_dtype": matmul_dtype}
    settings = {
        "all tokens": AnalysisConfig(filter="none", **common),
        f"top {1 - filter_quantile:.0%} entropy": AnalysisConfig(
            filter="quantile", filter_value=filter_quantile, **common),
    }
    if with_special:
        settings["all + special"] = AnalysisConfig(filter="none", exclude_special=False,
                                                   **common)
    return settings


def token_keep_mask(store, config: AnalysisConfig) -> tuple[torch.Tensor, dict]:
    """Keep mask ``(n_tokens,)`` over the whole store from its columns, and the counts.

    ``filter_kept_fraction`` = tokens passing the entropy filter / candidate tokens; the
    share of all stored tokens that was used is ``LayerStats.kept_fraction``.
    """
    entropy = store.column("entropy")
    excluded = torch.zeros_like(entropy, dtype=torch.bool)
    if config.exclude_special:
        excluded |= store.column("special").to(torch.bool)
    if config.only_loss_mask:
        excluded |= ~store.column("loss_mask").to(torch.bool)
    threshold = config.filter_value if config.filter == "threshold" else None
    quantile = config.filter_value if config.filter == "quantile" else None
    keep = token_filter(entropy, threshold=threshold, quantile=quantile, special=excluded)
    counts = {"n_store_tokens": int(entropy.numel()), "n_candidates": int((~excluded).sum()),
              "n_filter_kept": int(keep.sum())}
    if config.max_tokens is not None and counts["n_filter_kept"] > config.max_tokens:
        kept_ids = keep.nonzero().squeeze(1)  # (n_kept,)
        generator = torch.Generator().manual_seed(config.seed)
        chosen = kept_ids[torch.randperm(kept_ids.numel(), generator=generator)[:config.max_tokens]]
        keep = torch.zeros_like(keep)
        keep[chosen] = True
    counts["n_used"] = int(keep.sum())
    counts["filter_kept_fraction"] = counts["n_filter_kept"] / max(counts["n_candidates"], 1)
    return keep, counts


def available_bytes(device: str | torch.device) -> int | None:
    """Free memory on ``device``: CUDA's free bytes, or MemAvailable from /proc/meminfo."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # unknown (not Linux): no check


def check_memory(num_layers: int, dim: int, device: str | torch.device,
                 memory_budget: int | None = None) -> int:
    """Refuse an all-pairs streaming pass whose accumulators cannot fit; return its bytes.

    The L(L+1)/2 d×d float64 cross-covariance blocks grow as L²d²: 1.3 GB for
    SmolLM2-135M (31 layers × 576), ~75 GB for an 8B Llama (33 × 4096). The limit is
    ``memory_budget`` bytes if given, else the device's free memory.
    """
    need = StreamingLayerStats.accumulator_bytes(num_layers, dim)
    free = available_bytes(device) if memory_budget is None else memory_budget
    if free is not None and need > free:
        where = f"{device} has" if memory_budget is None else "memory_budget allows"
        raise MemoryError(
            f"layer statistics over {num_layers} layers × d={dim} need {need / 2**30:.1f} GiB "
            f"of float64 accumulators (L(L+1)/2·d²·8 bytes) but {where} "
            f"{free / 2**30:.1f} GiB; use route='block_pairs' (memory set by memory_budget, "
            "no aggregate Shannon entropies), a machine with more memory or a model with "
            "fewer/narrower layers")
    return need


def _kept_shards(store, keep: torch.Tensor, config: AnalysisConfig, progress: bool,
                 desc: str = "layer stats"):
    """Per shard: (hidden ``(N+1, n, D)``, its slice of ``keep``); checks the token count."""
    offset = 0
    shards = store.iter_shards(columns=())
    for shard in tqdm(shards, total=len(store.manifest["shards"]), desc=desc,
                      disable=not progress, mininterval=10):
        n_shard = shard["hidden"].shape[1]
        hidden = unit_rows(shard["hidden"]) if config.row_normalize else shard["hidden"]
        yield hidden, keep[offset:offset + n_shard]
        offset += n_shard
    if offset != keep.numel():
        raise ValueError(f"store shards hold {offset} tokens but its columns {keep.numel()}")


def _stream_store(store, keep: torch.Tensor, device, progress: bool,
                  config: AnalysisConfig) -> LayerStats:
    stream = StreamingLayerStats(store.num_layers + 1, store.hidden_size, device,
                                 matmul_dtype=getattr(torch, config.matmul_dtype))
    for hidden, kept in _kept_shards(store, keep, config, progress):
        stream.update(hidden, kept)
    return stream.finalize()


def _stream_store_blocks(store, keep: torch.Tensor, device, progress: bool,
                         config: AnalysisConfig, memory_budget: int) -> tuple[LayerStats, int]:
    """Block-pair passes over the store (``actwave.stats.blockstats``) -> (stats, passes)."""
    return block_pair_layer_stats(
        lambda: _kept_shards(store, keep, config, progress, "layer stats (block pass)"),
        store.num_layers + 1, store.hidden_size, memory_budget, torch.device(device),
        matmul_dtype=getattr(torch, config.matmul_dtype))


def _cache_key(store, config: AnalysisConfig) -> dict:
    """The store's content digest (not its config: a store deleted and recaptured with other
    contents gets new statistics) and the analysis config."""
    return {"store": store.digest, "analysis": config.key()}


def save_layer_stats(directory: Path, stats: LayerStats, key: dict, **extra) -> None:
    """Tensors to ``stats.safetensors``, the rest to ``stats.json``, then ``config.json``
    (with both files' size and sha256 under ``files``)."""
    record = stats.to_dict()
    tensors = {k: v.detach().cpu().contiguous() for k, v in record.items()
               if isinstance(v, torch.Tensor)}
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".stats.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, directory / "stats.safetensors")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    write_record(directory / "stats.json",
                 {k: v for k, v in record.items() if not isinstance(v, torch.Tensor)})
    files = {name: file_record(directory / name) for name in STATS_FILES}
    save_config_record(directory, key, files=files, **extra)


STATS_FILES = ("stats.safetensors", "stats.json")
STATS_REPAIR = ("actwave.stats.analysis.compute_layer_stats(store, config) with the same arguments "
                "recomputes it (notebooks 02-05: ./reproduce.sh --only 02)")


def load_layer_stats(directory: Path, key: dict | None = None) -> LayerStats:
    """Load a saved ``LayerStats``; refuse it if ``key`` differs from the recorded config or a
    file fails its recorded size/sha256 (IntegrityError; checked once per process)."""
    recorded = read_record(directory / "config.json", STATS_REPAIR)
    if key is not None and recorded["config"] != to_jsonable(key):
        raise ValueError(f"cached layer stats at {directory} were made for {recorded['config']},"
                         f" not {to_jsonable(key)}; delete that folder to recompute")
    files = recorded.get("files", {})
    missing = [name for name in STATS_FILES if "sha256" not in files.get(name, {})]
    if missing:
        raise IntegrityError(directory / "config.json", "file records", list(STATS_FILES),
                             f"none for {missing}", STATS_REPAIR)
    for name in STATS_FILES:
        verify_once(directory / name, files[name], STATS_REPAIR)
    meta = read_record(directory / "stats.json", STATS_REPAIR)
    return LayerStats.from_dict({**meta, **load_file(directory / "stats.safetensors")})


def compute_layer_stats(store, config: AnalysisConfig, device: str | torch.device = "cpu",
                        progress: bool = True, name: str | None = None, *,
                        route: str = "all_pairs",
                        memory_budget: int | None = None) -> LayerStats:
    """``LayerStats`` over the store's tokens kept by ``config`` (all N+1 layers), cached.

    The artifact is keyed by the store's content digest and ``config``; a second call loads
    it, and recomputes it if it fails verification (the repair). ``name`` (default: the
    store folder's name) prefixes the artifact folder. One writer per folder (WriterLock).
    ``route`` (``ROUTES``): 'all_pairs' keeps every covariance block; 'block_pairs' holds at
    most ``memory_budget`` bytes (default: the device's free memory) over several passes and
    returns no blocks. Both give the same numbers, so the route is not in the key; it is
    recorded in ``config.json``, and an 'all_pairs' call recomputes a cached 'block_pairs'
    artifact (which lacks the blocks).
    """
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    key = _cache_key(store, config)
    directory = artifact_dir("layer_stats", key, name or Path(store.path).name)
    with WriterLock(directory):
        if (directory / "config.json").exists():
            try:
                recorded = read_record(directory / "config.json", STATS_REPAIR)
                if route == "block_pairs" or recorded.get("route", "all_pairs") == "all_pairs":
                    log.info("layer stats: loading cache %s", directory)
                    return load_layer_stats(directory, key)
                log.info("layer stats: cached without covariance blocks; recomputing all pairs")
            except IntegrityError as err:
                log.warning("recomputing layer stats: %s", err)
            (directory / "config.json").unlink()
        return _compute_and_save(store, config, directory, key, device, progress, route,
                                 memory_budget)


def _compute_and_save(store, config: AnalysisConfig, directory: Path, key: dict,
                      device: str | torch.device, progress: bool, route: str,
                      memory_budget: int | None) -> LayerStats:
    """The kept tokens' statistics by ``route``, saved into ``directory`` and read back."""
    if route == "all_pairs":
        check_memory(store.num_layers + 1, store.hidden_size, device, memory_budget)
    elif memory_budget is None:
        memory_budget = available_bytes(device)
        if memory_budget is None:
            raise ValueError(f"route='block_pairs' needs memory_budget (bytes): the free "
                             f"memory of {device} is unknown here")
    keep, counts = token_keep_mask(store, config)
    log.info("layer stats: %d of %d tokens kept (%s)", counts["n_used"],
             counts["n_store_tokens"], config.filter)
    if counts["n_used"] < 4:
        raise ValueError(f"only {counts['n_used']} tokens survive the filter {config}; need ≥ 4")
    if route == "all_pairs":
        stats, record = _stream_store(store, keep, device, progress, config), {}
    else:
        stats, passes = _stream_store_blocks(store, keep, device, progress, config,
                                             memory_budget)
        record = {"memory_budget": memory_budget, "passes": passes}
    save_layer_stats(directory, stats, key, seed=config.seed, token_counts=counts, route=route,
                     **record)
    return load_layer_stats(directory, key)


def per_layer_stats(stores: dict, settings: dict[str, AnalysisConfig],
                    device: str | torch.device = "cpu") -> dict[tuple[str, str], LayerStats]:
    """Cached per-layer statistics, covariance blocks dropped, for every store × token set.

    stores: {model: CaptureStore}; settings: {label: AnalysisConfig} -> {(model, label): stats}.
    """
    return {(name, label): compute_layer_stats(captured, config, device=device).without_cov()
            for name, captured in stores.items() for label, config in settings.items()}
