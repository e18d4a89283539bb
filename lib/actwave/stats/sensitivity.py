"""Is the wave real? Sensitivity of the layer statistics and of what is read from them.

Three checks (docs/METHODS.md conventions: layer ids ℓ = 0..N, entropies in nats):

* **Token and scale variants** — the per-layer entropy curve and the selected layer sets
  under several predictive-entropy filter quantiles and with row-normalised states
  (``variant_configs``, ``AnalysisConfig.row_normalize``), and the share of the top
  covariance eigenvalue per layer (``top_eigen_shares``): near 1, a few outlier
  (massive-activation) dimensions carry the variance and drive the entropy.
* **Compartments across modularity resolutions** γ (``metrics.compartments``).
* **A bootstrap over sequences** (``bootstrap_compartments``): each replicate resamples the
  store's sequences with replacement, subsamples at most ``boot_tokens`` of their tokens,
  computes debiased linear CKA between all layers by the Gram route
  (``metrics.linear_cka_matrix``) and the compartments at every γ; ``segmentation_shares``,
  ``boundary_shares`` and ``default_coverage`` say what survives.

Everything but ``gather_states`` (which reads the capture store through its API) and
``bootstrap_compartments`` (which calls it) is pure.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from actwave.integrity import Between, check_fields
from actwave.stats import layerstats, metrics, selection_report
from actwave.stats.analysis import AnalysisConfig

# The selection methods whose picks are compared across variants by default; the EAGLE-3
# default set is always added as the baseline.
METHODS_STUDIED = ("renyi2_exhaustive", "logdet_dpp", "mrmr", "entropy_topk",
                   "cka_compartments", "greedy_aggregate_entropy")
Blocks = tuple[tuple[int, int], ...]


# ----------------------------------------------------------------------------- variants
def parse_values(text: str, name: str, low: float, high: float) -> tuple[float, ...]:
    """Comma-separated numbers ("0,0.25") as floats in [low, high), or a ValueError naming
    ``name``, the bad item and the allowed range."""
    values = []
    for item in (part.strip() for part in str(text).split(",")):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"{name}: {item!r} is not a number (expected e.g. '0,0.5')") from None
        if not low <= value < high:
            raise ValueError(f"{name}: {value} outside the allowed range [{low}, {high})")
        values.append(value)
    return tuple(values)


def variant_label(quantile: float, row_normalize: bool) -> str:
    """Table label of a variant: 'all tokens' or 'q≥0.5', plus ' · unit rows'."""
    tokens = "all tokens" if quantile == 0 else f"q≥{quantile:g}"
    return tokens + (" · unit rows" if row_normalize else "")


def variant_configs(quantiles: Sequence[float], normalized_quantiles: Sequence[float],
                    seed: int = 0, matmul_dtype: str = "float64") -> dict[str, AnalysisConfig]:
    """{label: AnalysisConfig} of every variant: each filter quantile on raw states, then
    each of ``normalized_quantiles`` on row-normalised states. Quantile 0 means no filter
    (the same config, hence the same cache, as the analysis notebooks' "all tokens"); it
    must be among ``quantiles``: the other variants are compared with it."""
    if 0 not in quantiles:
        raise ValueError(f"quantiles {tuple(quantiles)} must include 0 (every non-special "
                         "token, the reference variant)")
    variants = {}
    for row_normalize, values in ((False, quantiles), (True, normalized_quantiles)):
        for q in values:
            token_filter = {"filter": "none"} if q == 0 else {"filter": "quantile",
                                                               "filter_value": float(q)}
            variants[variant_label(q, row_normalize)] = AnalysisConfig(
                **token_filter, seed=seed, matmul_dtype=matmul_dtype,
                row_normalize=row_normalize)
    return variants


def top_eigen_shares(stats: layerstats.LayerStats) -> Tensor:
    """``(L,)`` λ_max / Σλ of each layer's covariance block (``stats`` with covariances)."""
    return torch.tensor([metrics.top_eigen_share(stats.block(layer, layer))
                         for layer in stats.layers], dtype=torch.float64)


def selected_sets(stats: layerstats.LayerStats, config: selection_report.SelectionConfig,
                  methods: Sequence[str] = METHODS_STUDIED) -> list[dict]:
    """``selection_report.compare_methods`` rows of ``methods`` and ``eagle3_default`` with
    the config's options (greedy_aggregate_entropy needs ``stats`` with covariances and
    ~(N·k)·(k·d)³ flops: minutes on a loaded 2-core CPU)."""
    known = config.methods()
    unknown = sorted(set(methods) - set(known))
    if unknown:
        raise ValueError(f"unknown selection methods {unknown}; known: {sorted(known)}")
    chosen = {label: known[label] for label in (*methods, "eagle3_default")}
    return selection_report.compare_methods(stats, chosen, k=config.k)


# ----------------------------------------------------------------------------- segmentations
def segmentations(cka: Tensor, resolutions: Sequence[float],
                  layers: Sequence[int] | None = None) -> dict[float, Blocks]:
    """{γ: compartments of ``cka: (L, L)`` at resolution γ as (first, last) layer ids}."""
    layers = list(range(cka.shape[0])) if layers is None else [int(v) for v in layers]
    return {float(gamma): tuple((layers[first], layers[last]) for first, last in
                                metrics.compartments(cka, resolution=float(gamma)))
            for gamma in resolutions}


def format_blocks(blocks: Blocks) -> str:
    """'0-1|2-14|15-30': one 'first-last' per compartment, in depth order."""
    return "|".join(f"{first}-{last}" for first, last in blocks)


def boundaries(blocks: Blocks) -> tuple[int, ...]:
    """Layers that open a compartment, the first excepted (a cut just before each)."""
    return tuple(first for first, _ in blocks[1:])


def coverage(blocks: Blocks, layers: Sequence[int]) -> dict[str, bool | int]:
    """How a layer set sits in a segmentation: ``hits_all`` (every compartment holds one of
    its layers), ``one_per_block`` (no two of its layers share a compartment), ``n_blocks``."""
    block_of = [next(i for i, (first, last) in enumerate(blocks) if first <= v <= last)
                for v in layers]
    return {"hits_all": len(set(block_of)) == len(blocks),
            "one_per_block": len(set(block_of)) == len(block_of), "n_blocks": len(blocks)}


# ----------------------------------------------------------------------------- bootstrap
@dataclass
class BootstrapConfig:
    """Compartment bootstrap: ``n_boot`` replicates over sequences, each on at most
    ``boot_tokens`` tokens, compartments at every γ of ``resolutions``; debiased CKA."""

    n_boot: int = 20
    boot_tokens: int = 3000
    resolutions: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, {"seed": Between(0)})
        if self.n_boot < 1 or self.boot_tokens < metrics.MIN_TOKENS_DEBIASED:
            raise ValueError(f"need n_boot ≥ 1 and boot_tokens ≥ {metrics.MIN_TOKENS_DEBIASED},"
                             f" got n_boot={self.n_boot}, boot_tokens={self.boot_tokens}")
        if not self.resolutions or min(self.resolutions) <= 0:
            raise ValueError(f"resolutions must be a non-empty list of γ > 0, "
                             f"got {self.resolutions}")


def sequence_groups(seq_index: Tensor, keep: Tensor) -> list[Tensor]:
    """Token ids (LongTensor) of the kept tokens of each sequence, ``seq_index, keep: (n,)``."""
    kept = keep.nonzero().squeeze(1)  # (n_kept,)
    sequences = seq_index[kept]
    return [kept[sequences == s] for s in torch.unique(sequences)]


def resample_tokens(groups: Sequence[Tensor], max_tokens: int,
                    generator: torch.Generator) -> Tensor:
    """One bootstrap replicate: sequences drawn with replacement (as many as there are),
    then at most ``max_tokens`` of their tokens without replacement. Sorted ids ``(m,)``,
    repeated where a sequence was drawn more than once."""
    draws = torch.randint(len(groups), (len(groups),), generator=generator)
    pooled = torch.cat([groups[i] for i in draws.tolist()])
    if pooled.numel() > max_tokens:
        pooled = pooled[torch.randperm(pooled.numel(), generator=generator)[:max_tokens]]
    return pooled.sort().values


def gather_states(store, token_ids: Tensor) -> Tensor:
    """Hidden states of all N+1 layers at sorted ``token_ids: (m,)`` (repeats kept), read
    shard by shard through the store API -> ``(N+1, m, d)`` float32."""
    parts, offset = [], 0
    for shard in store.iter_shards(columns=()):
        n_shard = shard["hidden"].shape[1]
        inside = (token_ids >= offset) & (token_ids < offset + n_shard)
        parts.append(shard["hidden"][:, token_ids[inside] - offset].to(torch.float32))
        offset += n_shard
    return torch.cat(parts, dim=1)


def bootstrap_compartments(store, keep: Tensor, config: BootstrapConfig,
                           progress: bool = True) -> list[dict]:
    """Compartments per bootstrap replicate and resolution over the ``keep: (n,)`` tokens.

    Returns one record per (replicate, γ): ``replicate``, ``resolution``, ``blocks`` (layer
    ids), ``n_tokens``. Replicate r draws from its own generator (seed, r), so any one of
    them can be recomputed alone.
    """
    groups = sequence_groups(store.column("seq_index"), keep)
    records = []
    for replicate in tqdm(range(config.n_boot), desc="bootstrap", disable=not progress,
                          mininterval=30):
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + replicate)
        token_ids = resample_tokens(groups, config.boot_tokens, generator)
        cka = metrics.linear_cka_matrix(gather_states(store, token_ids), debiased=True)
        for gamma, blocks in segmentations(cka, config.resolutions).items():
            records.append({"replicate": replicate, "resolution": gamma, "blocks": blocks,
                            "n_tokens": int(token_ids.numel())})
    return records


def segmentation_shares(records: Sequence[dict]) -> list[dict]:
    """Share of replicates giving each segmentation, per resolution (shares sum to 1)."""
    counts = Counter((r["resolution"], r["blocks"]) for r in records)
    totals = Counter(r["resolution"] for r in records)
    return [{"resolution": gamma, "segmentation": format_blocks(blocks),
             "n_blocks": len(blocks), "share": count / totals[gamma]}
            for (gamma, blocks), count in counts.items()]


def boundary_shares(records: Sequence[dict]) -> list[dict]:
    """Share of replicates with a compartment opening at each layer, per resolution."""
    counts = Counter((r["resolution"], layer) for r in records for layer in boundaries(r["blocks"]))
    totals = Counter(r["resolution"] for r in records)
    return [{"resolution": gamma, "boundary_before_layer": layer, "share": count / totals[gamma]}
            for (gamma, layer), count in counts.items()]


def default_coverage(records: Sequence[dict], layers: Sequence[int]) -> list[dict]:
    """Per resolution: the share of replicates in which ``layers`` hits every compartment,
    the share with one layer per compartment it touches, and the mean number of blocks."""
    by_gamma: dict[float, list[dict]] = {}
    for record in records:
        by_gamma.setdefault(record["resolution"], []).append(coverage(record["blocks"], layers))
    return [{"resolution": gamma, "n_replicates": len(rows),
             "hits_all_share": sum(r["hits_all"] for r in rows) / len(rows),
             "one_per_block_share": sum(r["one_per_block"] for r in rows) / len(rows),
             "mean_blocks": sum(r["n_blocks"] for r in rows) / len(rows)}
            for gamma, rows in by_gamma.items()]
