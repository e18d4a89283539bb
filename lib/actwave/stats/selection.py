"""Choosing k hidden-state layers to feed an EAGLE-3 draft (pure functions).

Layer ids are indices ℓ ∈ {0..N} = number of decoder blocks applied (docs/METHODS.md §2).
Every method works on the statistics of ``actwave.stats.layerstats.LayerStats`` (per-layer matrix
entropy, the L×L linear-CKA matrix, the covariance blocks) and returns a sorted tuple of
layer ids.

Candidates: by default every layer of the stats except ℓ = 0. The embedding output is the
draft's own input already (EAGLE-3 feeds ``emb(x_{t+1})`` beside the fused target
features), so a target state at ℓ = 0 adds nothing the draft lacks; pass ``candidates``
to include it.

Objectives (higher is better; all are scores of a set, ``score_fn(subsets: (S, k)) -> (S,)``):

* ``entropy_sum``  Σ_{ℓ∈S} H₁(ℓ) — informativeness only (modular).
* ``renyi2``       H₂ of the concatenation [h_a; …] with each layer at unit Frobenius norm,
  exact closed form exp(−H₂(S)) = k⁻²[Σ_a P_a + 2Σ_{a<b} CKA_ab √(P_a P_b)] — entropy and
  redundancy in one tuning-free score.
* ``logdet``       log det L_S with the DPP kernel L = diag(q) C diag(q), q_ℓ = exp(θ H₁(ℓ)),
  C = CKA: 2θ Σ H₁ + log det C_S (Kulesza & Taskar; quality × diversity).
* ``dispersion``   min_{a<b∈S} (1 − CKA_ab) — geometric diversity only.

Methods (``METHODS``, dispatched by ``select``): fixed baselines (eagle3_default,
evenly_spaced, last_k, first_k, random); entropy-only (entropy_topk); entropy+CKA
(greedy_aggregate_entropy, renyi2_exhaustive, logdet_dpp, mrmr); CKA-only (cka_farthest,
cka_compartments). All but cka_compartments and the fixed baselines ignore depth order:
permuting the layers' statistics permutes the chosen set (up to ties, which go to the
earlier candidate).

Reports built on these (method comparison, set profiles, pair matrices, the selection
stage's config) live in ``actwave.stats.selection_report``.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from actwave.integrity import int_ids
from actwave.stats import layerstats, metrics

ScoreFn = Callable[[Tensor], Tensor]
# Size guards: exhaustive search holds all C(n, k) subsets as int64 ids (+ a score each);
# greedy aggregate entropy does Σ_m (n−m+1) eigendecompositions of (m·d)² matrices,
# ≈ 9·(m·d)³ flops each (LAPACK syevd). Above these limits a call is refused with its size.
MAX_SUBSETS = 5_000_000
MAX_EIGH_FLOPS = 2e13
FAST_METHODS = "greedy methods (mrmr, cka_farthest, logdet_dpp with search='greedy')"


# ----------------------------------------------------------------------------- checks
def check_k(k: int, n_candidates: int) -> int:
    """``k`` if it is an int in [1, n_candidates], else a ValueError naming it."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_candidates:
        raise ValueError(f"k must be an int in [1, {n_candidates}] (the number of candidate "
                         f"layers), got {k!r}")
    return k


def _check_num_layers(num_layers: int, minimum: int = 1) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < minimum:
        raise ValueError(f"number of decoder layers N must be an int ≥ {minimum}, "
                         f"got {num_layers!r}")
    return num_layers


def default_candidates(layers: Sequence[int]) -> tuple[int, ...]:
    """All layer ids but ℓ = 0 (the embedding output the draft already receives)."""
    return tuple(int(layer) for layer in layers if int(layer) != 0)


def resolve_candidates(stats: Any, candidates: Sequence[int] | None = None) -> tuple[int, ...]:
    """Sorted candidate layer ids, checked against ``stats.layers``; default excludes ℓ = 0."""
    if candidates is None:
        return tuple(sorted(default_candidates(stats.layers)))
    chosen = list(int_ids("candidates", candidates))
    unknown = sorted(set(chosen) - set(stats.layers))
    if unknown or len(set(chosen)) != len(chosen) or not chosen:
        raise ValueError(f"candidates must be distinct layers of the stats "
                         f"{list(stats.layers)}; got {list(candidates)} (unknown: {unknown})")
    return tuple(sorted(chosen))


# ----------------------------------------------------------------------------- baselines
def eagle3_default(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's rule ``(2, N//2, N-3)``: states entering blocks 2, N//2 and N-3.

    Three distinct increasing layers need N ≥ 7; smaller models should pass layer ids
    explicitly.
    """
    _check_num_layers(num_layers, minimum=7)
    return (2, num_layers // 2, num_layers - 3)


def evenly_spaced(num_layers: int, k: int) -> tuple[int, ...]:
    """Centres of k equal-width bins of layers 1..N (N=30, k=3 → 5, 15, 25)."""
    check_k(k, _check_num_layers(num_layers))
    # centre of bin i is 0.5 + (2i+1)N/(2k); integer floor of it:
    return tuple((k + (2 * i + 1) * num_layers) // (2 * k) for i in range(k))


def last_k(num_layers: int, k: int) -> tuple[int, ...]:
    """The k deepest layers N-k+1..N (ℓ = N is the last block's output, before the norm)."""
    check_k(k, _check_num_layers(num_layers))
    return tuple(range(num_layers - k + 1, num_layers + 1))


def first_k(num_layers: int, k: int) -> tuple[int, ...]:
    """The k shallowest candidates 1..k — adjacent early layers, a deliberately poor control."""
    check_k(k, _check_num_layers(num_layers))
    return tuple(range(1, k + 1))


def random_layers(num_layers: int, k: int, seed: int,
                  candidates: Sequence[int] | None = None) -> tuple[int, ...]:
    """k distinct layers drawn uniformly from ``candidates`` (default 1..N), seeded (CPU RNG)."""
    pool = list(range(1, _check_num_layers(num_layers) + 1)) if candidates is None \
        else sorted(int(c) for c in candidates)
    check_k(k, len(pool))
    generator = torch.Generator().manual_seed(int(seed))
    picks = torch.randperm(len(pool), generator=generator)[:k]
    return tuple(sorted(pool[i] for i in picks.tolist()))


# ----------------------------------------------------------------------------- search
def all_subsets(num_layers_or_candidates: int | Sequence[int], k: int) -> Tensor:
    """All k-subsets, lexicographic: LongTensor ``(C(n, k), k)``, rows ascending.

    An int N means candidates 1..N (ℓ = 0 excluded, see the module docstring).
    """
    if isinstance(num_layers_or_candidates, int):
        pool = list(range(1, _check_num_layers(num_layers_or_candidates) + 1))
    else:
        pool = sorted(int_ids("candidates", num_layers_or_candidates))
    check_k(k, len(pool))
    check_subset_count(len(pool), k)
    # itertools, not torch.combinations: the latter builds an n^k grid first (5.8 GB for 30, 6).
    return torch.tensor(list(itertools.combinations(pool, k)), dtype=torch.long)  # (S, k)


def check_subset_count(n: int, k: int, limit: int = MAX_SUBSETS) -> int:
    """C(n, k), refused (ValueError with the count and bytes) above ``limit``."""
    count = math.comb(n, k)
    if count > limit:
        raise ValueError(f"exhaustive search over C({n}, {k}) = {count:,} subsets needs "
                         f"{count * (k + 1) * 8 / 1e9:.1f} GB of ids and scores (limit {limit:,}"
                         f" subsets); use one of the {FAST_METHODS} or fewer candidates")
    return count


def greedy_entropy_cost(n: int, k: int, dim: int) -> dict[str, float]:
    """Cost of ``greedy_aggregate_entropy``: eigendecompositions, largest matrix side, flops."""
    sizes = [(n - m + 1, m * dim) for m in range(1, k + 1)]
    return {"eigendecompositions": sum(count for count, _ in sizes),
            "largest_matrix": k * dim,
            "flops": sum(9.0 * count * side ** 3 for count, side in sizes)}


def exhaustive(score_fn: ScoreFn, candidates: Sequence[int], k: int,
               batch: int = 65536) -> tuple[tuple[int, ...], Tensor, Tensor]:
    """Score every k-subset of ``candidates``; the best one (first on ties), all scores.

    score_fn: LongTensor ``(S, k)`` of layer ids -> ``(S,)`` scores, called on batches of
    at most ``batch`` rows. Returns ``(best, subsets (S, k), scores (S,))``.
    """
    subsets = all_subsets(list(candidates), k)  # (S, k)
    scores = torch.cat([score_fn(chunk) for chunk in subsets.split(batch)])  # (S,)
    best = int(torch.argmax(torch.nan_to_num(scores, nan=-math.inf)))
    return tuple(subsets[best].tolist()), subsets, scores


def greedy(step_fn: ScoreFn, candidates: Sequence[int], k: int) -> tuple[int, ...]:
    """Forward selection: k times add the candidate with the best ``step_fn`` (first on ties).

    step_fn: LongTensor ``(R, m+1)`` — the m layers chosen so far (in pick order) plus one
    new candidate in the last column — -> ``(R,)`` scores. A set objective works as is;
    an incremental criterion (mRMR) reads the last column.
    """
    pool = [int(c) for c in candidates]
    check_k(k, len(pool))
    chosen: list[int] = []
    for _ in range(k):
        remaining = torch.tensor([c for c in pool if c not in chosen], dtype=torch.long)
        trial = torch.cat([torch.tensor(chosen, dtype=torch.long).expand(len(remaining), -1),
                           remaining[:, None]], dim=1)  # (R, m+1)
        scores = torch.nan_to_num(step_fn(trial), nan=-math.inf)
        chosen.append(int(remaining[int(torch.argmax(scores))]))
    return tuple(sorted(chosen))


def percentile(score_of_set: float | Tensor, all_scores: Tensor) -> float:
    """Share (%) of all subsets scoring at most ``score_of_set`` (the best gets 100)."""
    scores = torch.as_tensor(all_scores).reshape(-1)
    if scores.numel() == 0:
        raise ValueError("all_scores is empty")
    return 100.0 * float((scores <= float(score_of_set)).double().mean())


def score_of(subset: Sequence[int], subsets: Tensor, scores: Tensor) -> float:
    """The score of one sorted ``subset`` looked up in an ``exhaustive`` result."""
    target = torch.tensor(sorted(int(v) for v in subset), dtype=subsets.dtype)
    hits = (subsets == target).all(dim=1).nonzero()
    if hits.numel() == 0:
        raise ValueError(f"subset {tuple(subset)} is not among the scored subsets")
    return float(scores[int(hits[0])])


# ----------------------------------------------------------------------------- objectives
def cka_matrix(stats: Any, debiased: bool) -> Tensor:
    """The stats' ``(L, L)`` linear CKA: debiased (Székely–Rizzo) or the biased plug-in."""
    return stats.cka if debiased else stats.cka_biased


def entropy_sum_score(stats: Any) -> ScoreFn:
    """Σ_{ℓ∈S} H₁(ℓ) (nats)."""
    return lambda subsets: stats.entropy[stats.rows(subsets)].sum(dim=-1)


def renyi2_score(stats: Any) -> ScoreFn:
    """Rényi-2 entropy (nats) of the normalised concatenation, closed form in layerstats."""
    return lambda subsets: layerstats.aggregate_renyi2(stats, subsets)


def aggregate_score(stats: Any, alpha: float = 1.0) -> ScoreFn:
    """Rényi-α (α=1: Shannon) entropy of the normalised concatenation, one set at a time.

    Needs the covariance blocks and one (k·d)² eigendecomposition per set: for the top
    candidates, not for all subsets of a deep model on CPU (use ``renyi2_score`` there).
    """
    if alpha == 2.0:
        return renyi2_score(stats)
    return lambda subsets: torch.tensor(
        [float(layerstats.aggregate_entropy(stats, row.tolist(), alpha=alpha)) for row in subsets],
        dtype=torch.float64)


def logdet_score(stats: Any, theta: float = 1.0, debiased: bool = True) -> ScoreFn:
    """log det L_S, L = diag(q) C diag(q), q = exp(θ H₁): 2θ Σ H₁ + log det C_S.

    A non-positive det (possible for debiased CKA, which need not be PSD) scores −inf.
    """
    cka = cka_matrix(stats, debiased)

    def score(subsets: Tensor) -> Tensor:
        rows = stats.rows(subsets)  # (S, k)
        blocks = cka[rows[:, :, None], rows[:, None, :]]  # (S, k, k)
        sign, logabsdet = torch.linalg.slogdet(blocks.to(torch.float64))
        logdet = torch.where(sign > 0, logabsdet, torch.full_like(logabsdet, -math.inf))
        return 2.0 * theta * stats.entropy[rows].to(torch.float64).sum(dim=-1) + logdet

    return score


def dispersion_score(stats: Any, debiased: bool = True) -> ScoreFn:
    """min_{a<b∈S} (1 − CKA_ab); +inf for a single layer."""
    cka = cka_matrix(stats, debiased)

    def score(subsets: Tensor) -> Tensor:
        rows = stats.rows(subsets)  # (S, k)
        distance = 1.0 - cka[rows[:, :, None], rows[:, None, :]]  # (S, k, k)
        off_diagonal = ~torch.eye(rows.shape[1], dtype=torch.bool, device=distance.device)
        return distance.masked_fill(~off_diagonal, math.inf).flatten(1).amin(dim=1)

    return score


OBJECTIVES: dict[str, Callable[..., ScoreFn]] = {
    "entropy_sum": entropy_sum_score,
    "renyi2": renyi2_score,
    "logdet": logdet_score,
    "dispersion": dispersion_score,
}


def objective(name: str, stats: Any, **kwargs: Any) -> ScoreFn:
    """The score function of a named objective (see ``OBJECTIVES``) on ``stats``."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name](stats, **kwargs)


# ----------------------------------------------------------------------------- methods
# Each method: (stats, k, candidates, **options) -> tuple of layer ids. ``candidates`` is
# already resolved and k checked by ``select``.
def _num_layers(stats: Any) -> int:
    """N of a model whose stats cover layers 0..N."""
    return max(int(layer) for layer in stats.layers)


def entropy_topk(stats: Any, k: int, candidates: Sequence[int]) -> tuple[int, ...]:
    """argmax_S Σ_{ℓ∈S} H₁(ℓ): the k highest-entropy layers (ties: shallower first)."""
    pool = torch.tensor(list(candidates), dtype=torch.long)
    values = stats.entropy[stats.rows(pool)].cpu()
    order = torch.sort(values, descending=True, stable=True).indices[:k]
    return tuple(sorted(pool[order].tolist()))


def greedy_aggregate_entropy(stats: Any, k: int, candidates: Sequence[int],
                             alpha: float = 1.0) -> tuple[int, ...]:
    """Greedy max of the Rényi-α aggregate entropy H_α([h_a; …]) (α=1: Shannon).

    Starts from the highest-entropy single layer (the aggregate of one normalised layer is
    its own entropy) and adds the layer that maximises the entropy of the set. Refused
    above ``MAX_EIGH_FLOPS`` (see ``greedy_entropy_cost``).
    """
    cost = greedy_entropy_cost(len(candidates), k, int(stats.dim))
    if cost["flops"] > MAX_EIGH_FLOPS:
        raise ValueError(
            f"greedy_aggregate_entropy with {len(candidates)} candidates, k={k}, d={stats.dim} "
            f"needs {cost['eigendecompositions']} eigendecompositions up to "
            f"{cost['largest_matrix']}² (~{cost['flops']:.1e} flops, limit {MAX_EIGH_FLOPS:.0e});"
            " use renyi2_exhaustive (closed form, no eigendecompositions) or a smaller k")
    return greedy(aggregate_score(stats, alpha), candidates, k)


def renyi2_exhaustive(stats: Any, k: int, candidates: Sequence[int]) -> tuple[int, ...]:
    """argmax_S H₂([h_a; …]) over all C(n, k) subsets: the tuning-free entropy+CKA score."""
    return exhaustive(renyi2_score(stats), candidates, k)[0]


def logdet_dpp(stats: Any, k: int, candidates: Sequence[int], theta: float = 1.0,
               debiased: bool = True, search: str = "exhaustive") -> tuple[int, ...]:
    """argmax_S log det L_S, L = diag(q) C diag(q), q = exp(θ H₁), C = CKA (DPP MAP).

    ``search``: "exhaustive" (exact) or "greedy" (the usual greedy DPP MAP).
    """
    score = logdet_score(stats, theta=theta, debiased=debiased)
    if search == "exhaustive":
        return exhaustive(score, candidates, k)[0]
    if search == "greedy":
        return greedy(score, candidates, k)
    raise ValueError(f"search must be 'exhaustive' or 'greedy', got {search!r}")


def mrmr(stats: Any, k: int, candidates: Sequence[int], lam: float = 1.0,
         debiased: bool = True) -> tuple[int, ...]:
    """Max-relevance min-redundancy (Peng et al. 2005), greedy.

    Adds argmax_j [r_j − λ · mean_{s∈S} CKA_js], relevance r_j = H₁(j) / max_c H₁(c) ∈ (0, 1]
    (scale-free, comparable with CKA ∈ [0, 1]); the first pick is the highest-entropy layer.
    """
    cka = cka_matrix(stats, debiased)
    pool_rows = stats.rows(list(candidates))
    relevance = stats.entropy / stats.entropy[pool_rows].max()

    def step(trial: Tensor) -> Tensor:
        rows = stats.rows(trial).to(cka.device)  # (R, m+1)
        gain = relevance[rows[:, -1]]
        if rows.shape[1] == 1:
            return gain
        redundancy = cka[rows[:, -1:], rows[:, :-1]].mean(dim=1)  # (R,)
        return gain - lam * redundancy

    return greedy(step, candidates, k)


def cka_farthest(stats: Any, k: int, candidates: Sequence[int],
                 debiased: bool = True) -> tuple[int, ...]:
    """Farthest-point sampling on the distance 1 − CKA (greedy max-min dispersion).

    First pick: the candidate with the largest mean distance to the other candidates; then
    the candidate farthest from its nearest chosen layer. Uses no entropy (CKA-only).
    """
    cka = cka_matrix(stats, debiased)
    pool_rows = stats.rows(list(candidates)).to(cka.device)

    def step(trial: Tensor) -> Tensor:
        rows = stats.rows(trial).to(cka.device)  # (R, m+1)
        if rows.shape[1] == 1:
            return (1.0 - cka[rows[:, 0][:, None], pool_rows[None, :]]).mean(dim=1)
        return (1.0 - cka[rows[:, -1:], rows[:, :-1]]).amin(dim=1)

    return greedy(step, candidates, k)


def cka_compartments(stats: Any, k: int, candidates: Sequence[int],
                     compartments: Sequence[tuple[int, int]] | None = None,
                     debiased: bool = True) -> tuple[int, ...]:
    """One layer per CKA compartment: the highest-entropy candidate of each.

    Compartments (contiguous blocks of mutually similar layers, (first, last) layer ids,
    inclusive) default to ``compartment_layers(stats)``. Compartments are ranked by their
    best layer's entropy and the top k kept; with fewer than k, the rest are the
    highest-entropy remaining candidates.
    """
    if compartments is None:
        compartments = compartment_layers(stats, debiased=debiased)
    entropy = {c: float(stats.entropy[int(stats.rows([c])[0])]) for c in candidates}
    representatives = []
    for first, last in compartments:
        members = [c for c in candidates if first <= c <= last]
        if members:
            representatives.append(max(members, key=lambda c: (entropy[c], -c)))
    ranked = sorted(representatives, key=lambda c: (-entropy[c], c))[:k]
    rest = sorted((c for c in candidates if c not in ranked), key=lambda c: (-entropy[c], c))
    return tuple(sorted(ranked + rest[:k - len(ranked)]))


def compartment_layers(stats: Any, debiased: bool = True,
                       **options: Any) -> list[tuple[int, int]]:
    """``metrics.compartments`` of the stats' CKA as (first, last) layer ids, inclusive."""
    blocks = metrics.compartments(cka_matrix(stats, debiased), **options)
    return [(int(stats.layers[first]), int(stats.layers[last])) for first, last in blocks]


def _baseline(rule: Callable[..., tuple[int, ...]]) -> Callable[..., tuple[int, ...]]:
    """A stats-free baseline as a method: N = the deepest layer of the stats."""
    def method(stats: Any, k: int, candidates: Sequence[int], **options: Any) -> tuple[int, ...]:
        return rule(_num_layers(stats), k, **options)
    method.__doc__ = rule.__doc__
    return method


def _eagle3_method(stats: Any, k: int, candidates: Sequence[int]) -> tuple[int, ...]:
    if k != 3:
        raise ValueError(f"eagle3_default picks exactly 3 layers, got k={k}")
    return eagle3_default(_num_layers(stats))


def _random_method(stats: Any, k: int, candidates: Sequence[int],
                   seed: int = 0) -> tuple[int, ...]:
    return random_layers(_num_layers(stats), k, seed, candidates=candidates)


METHODS: dict[str, Callable[..., tuple[int, ...]]] = {
    "eagle3_default": _eagle3_method,
    "evenly_spaced": _baseline(evenly_spaced),
    "last_k": _baseline(last_k),
    "first_k": _baseline(first_k),
    "random": _random_method,
    "entropy_topk": entropy_topk,
    "greedy_aggregate_entropy": greedy_aggregate_entropy,
    "renyi2_exhaustive": renyi2_exhaustive,
    "logdet_dpp": logdet_dpp,
    "mrmr": mrmr,
    "cka_farthest": cka_farthest,
    "cka_compartments": cka_compartments,
}


def select(method: str, stats: Any, k: int = 3, candidates: Sequence[int] | None = None,
           **options: Any) -> tuple[int, ...]:
    """Layer ids chosen by ``method`` (a key of ``METHODS``), sorted.

    stats: ``layerstats.LayerStats`` over layers 0..N. candidates: layer ids allowed (default
    all but ℓ = 0; the fixed baselines eagle3_default/evenly_spaced/last_k/first_k ignore
    it). options: the method's keyword arguments (seed, alpha, lam, theta, ...).
    """
    if method not in METHODS:
        raise ValueError(f"unknown selection method {method!r}; known: {sorted(METHODS)}")
    pool = resolve_candidates(stats, candidates)
    check_k(k, len(pool))
    return tuple(sorted(int(v) for v in METHODS[method](stats, k, pool, **options)))
