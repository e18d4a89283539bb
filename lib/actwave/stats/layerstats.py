"""Per-layer and pairwise statistics of hidden states over one token set (pure math).

``LayerStats`` holds, for layers 0..N, the Shannon and Rényi-2 matrix entropies, both
linear CKA matrices and the centred cross-covariance blocks Σ_ab; ``StreamingLayerStats``
builds it in one float64 pass over token chunks, never forming an n×n Gram; the aggregate
entropies of concatenated layers (the paper's "entropy of layer sets") are read from it.
The estimators themselves (matrix entropy of a covariance, CKA from moments) live in
``actwave.stats.metrics``; docs/METHODS.md §4–§7 has the equations.

Everything here is device-agnostic: results live on the inputs' device.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from torch import Tensor

from actwave.stats.metrics import (MIN_TOKENS_DEBIASED, _check_alpha, _check_layers_finite,
                                   cka_from_moments, entropy_from_cov)

# Tokens per float64 working chunk of StreamingLayerStats.
CHUNK_TOKENS = 1024

@dataclass
class LayerStats:
    """Per-layer and pairwise statistics of hidden states over one token set.

    Rows follow ``layers`` (layer indices ℓ, usually 0..N). ``entropy``/``renyi2``:
    ``(L,)`` Shannon / Rényi-2 matrix entropy in nats. ``cka``: ``(L, L)`` debiased linear
    CKA; ``cka_biased``: biased. ``cov[(i, j)]`` for layer indices i ≤ j: the ``(d, d)``
    float64 centred cross-covariance Σᵢⱼ = Zᵢᶜᵀ Zⱼᶜ (unnormalised sums), from which
    aggregate entropies are built. ``n_seen``: tokens offered before filtering.
    """

    layers: tuple[int, ...]
    n_tokens: int
    dim: int
    entropy: Tensor
    renyi2: Tensor
    cka: Tensor
    cka_biased: Tensor
    cov: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    n_seen: int | None = None

    @property
    def kept_fraction(self) -> float | None:
        return None if not self.n_seen else self.n_tokens / self.n_seen

    def rows(self, layers: Sequence[int] | Tensor) -> Tensor:
        """Row positions (LongTensor) of layer indices, with a clear error for unknown ones."""
        lookup = {layer: row for row, layer in enumerate(self.layers)}
        flat = torch.as_tensor(layers).reshape(-1).tolist()
        missing = sorted({layer for layer in flat if layer not in lookup})
        if missing:
            raise ValueError(f"layers {missing} not in these stats (have {list(self.layers)})")
        shape = torch.as_tensor(layers).shape
        return torch.tensor([lookup[layer] for layer in flat], dtype=torch.long).reshape(shape)

    def block(self, i: int, j: int) -> Tensor:
        """Σᵢⱼ ``(d, d)`` for any order of layer indices i, j."""
        if not self.cov:
            raise ValueError("these LayerStats carry no covariance blocks (made by without_cov or "
                             "the block-pair route); compute them with route='all_pairs'")
        return self.cov[(i, j)] if i <= j else self.cov[(j, i)].T

    def without_cov(self) -> "LayerStats":
        """Copy without the covariance blocks (light; no aggregate Shannon entropy)."""
        return replace(self, cov={})

    def to_dict(self) -> dict:
        """Flat dict: tensors (entropy, renyi2, cka, cka_biased, ``cov.i.j``) + plain values."""
        out = {"layers": list(self.layers), "n_tokens": self.n_tokens, "dim": self.dim,
               "n_seen": self.n_seen, "entropy": self.entropy, "renyi2": self.renyi2,
               "cka": self.cka, "cka_biased": self.cka_biased}
        out.update({f"cov.{i}.{j}": block for (i, j), block in self.cov.items()})
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "LayerStats":
        cov = {}
        for key, value in data.items():
            if key.startswith("cov."):
                _, i, j = key.split(".")
                cov[(int(i), int(j))] = value
        return cls(layers=tuple(int(x) for x in data["layers"]), n_tokens=int(data["n_tokens"]),
                   dim=int(data["dim"]), entropy=torch.as_tensor(data["entropy"]),
                   renyi2=torch.as_tensor(data["renyi2"]), cka=torch.as_tensor(data["cka"]),
                   cka_biased=torch.as_tensor(data["cka_biased"]), cov=cov,
                   n_seen=data.get("n_seen"))


def centred_row_norm_products(sq_products: Tensor, sq_weighted: Tensor, sq_sums: Tensor,
                              mean: Tensor, bilinear: Tensor, n: int) -> Tensor:
    """(L, L) Σᵢ ‖x_a,ᵢ − μ_a‖² ‖x_b,ᵢ − μ_b‖² from sums of shifted tokens x.

    ``sq_products[a, b]`` = Σq_aq_b with q = ‖x‖², ``sq_weighted[a, b]`` = Σq_a x_b ``(L, L, d)``,
    ``sq_sums[a]`` = Σq_a, ``mean: (L, d)`` = Σx/n, ``bilinear[a, b]`` = μ_aᵀΣ_abμ_b with Σ_ab
    the centred block. With ‖x − μ‖² = q − 2μ·x + ‖μ‖², expanding the product and summing over
    tokens (Σx = nμ, Σ x_a x_bᵀ = Σ_ab + nμ_aμ_bᵀ) gives
    Σq_aq_b − 2μ_b·Σq_a x_b − 2μ_a·Σq_b x_a + ‖μ_b‖²Σq_a + ‖μ_a‖²Σq_b + 4μ_aᵀΣ_abμ_b
    + n‖μ_a‖²‖μ_b‖².
    """
    mean_sq = mean.square().sum(dim=1)  # (L,)
    weighted = torch.einsum("abd,bd->ab", sq_weighted, mean)  # μ_b·Σq_a x_b
    return (sq_products - 2 * weighted - 2 * weighted.T
            + torch.outer(sq_sums, mean_sq) + torch.outer(mean_sq, sq_sums)
            + 4 * bilinear + n * torch.outer(mean_sq, mean_sq))


def moment_sums(num_layers: int, dim: int, device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Zeroed float64 per-token moment sums that every streaming route keeps beside its
    covariance blocks: Σx_a (L, d), Σ‖x_a‖² (L,), Σ‖x_a‖²‖x_b‖² (L, L), Σ‖x_a‖² x_b (L, L, d)."""
    L, d, f64 = num_layers, dim, torch.float64
    return (torch.zeros(L, d, dtype=f64, device=device), torch.zeros(L, dtype=f64, device=device),
            torch.zeros(L, L, dtype=f64, device=device),
            torch.zeros(L, L, d, dtype=f64, device=device))


def add_moments(moments: tuple[Tensor, Tensor, Tensor, Tensor], x: Tensor) -> None:
    """Add the shifted tokens ``x: (L, m, d)`` (float64) to ``moment_sums``' four sums, in place."""
    sums, sq_sums, sq_products, sq_weighted = moments
    sq_norms = torch.linalg.vector_norm(x, dim=-1).square()  # (L, m)
    sums += x.sum(dim=1)
    sq_sums += sq_norms.sum(dim=1)
    sq_products += sq_norms @ sq_norms.T
    sq_weighted += torch.matmul(sq_norms[None], x).transpose(0, 1)  # [a, b] = Σ q_a x_b


def kept_tokens(hidden: Tensor, keep: Tensor | None, num_layers: int, dim: int) -> Tensor:
    """``hidden: (L, n, d)`` checked against (num_layers, dim), restricted to ``keep: (n,)``
    bool when given -> (L, n_kept, d). Both streaming routes take their input through here."""
    if hidden.ndim != 3 or hidden.shape[0] != num_layers or hidden.shape[2] != dim:
        raise ValueError(f"hidden must be (L={num_layers}, n, d={dim}), "
                         f"got {tuple(hidden.shape)}")
    if keep is None:
        return hidden
    if keep.dtype != torch.bool or keep.shape != (hidden.shape[1],):
        raise ValueError(f"keep must be a bool tensor of shape ({hidden.shape[1]},), "
                         f"got {keep.dtype} {tuple(keep.shape)}")
    return hidden[:, keep.to(hidden.device)]


class StreamingLayerStats:
    """``LayerStats`` of L layers in one pass over token chunks, never forming an n×n Gram.

    Per chunk, tokens shifted by a reference mean (the first chunk's, so the large mean of
    residual streams does not cancel catastrophically), it adds in float64: Σx (L, d),
    Σ‖x‖² (L,), Σ‖x_a‖²‖x_b‖² (L, L), Σ‖x_a‖² x_b (L, L, d) and the cross products
    Σ x_a x_bᵀ (d, d) for every pair a ≤ b. Centred covariances follow by subtracting the
    mean outer product; the debiased-HSIC row-norm term Σᵢ‖x̄_a,ᵢ‖²‖x̄_b,ᵢ‖² of centred
    rows x̄ = x − μ expands into these sums (see ``_centred_row_norm_products``).

    Memory: L(L+1)/2 · d² float64 (31 layers × 576: 1.3 GB) plus one float64 chunk of
    ``chunk_tokens`` tokens. ``finalize`` turns the accumulators into the covariance blocks
    in place (no copy), after which ``update`` is refused.

    Cost: n·d²·L(L+1) flops in the cross products. ``matmul_dtype=torch.float32`` runs
    them in float32 per chunk (≈2× faster on CPU; relative error ~1e-6 after the mean
    shift) while every sum across chunks stays float64; the default is float64 throughout.

    Streams over disjoint token shards combine by adding their ``partial_sums`` (one
    all-reduce, ``actwave.stats.distributed``) when all of them were given the same ``reference:
    (L, d)`` shift; the counts ``n_tokens`` and ``n_seen`` add likewise.
    """

    def __init__(self, num_layers: int, dim: int, device: torch.device | str | None = None,
                 *, layers: Sequence[int] | None = None, chunk_tokens: int = CHUNK_TOKENS,
                 matmul_dtype: torch.dtype = torch.float64,
                 reference: Tensor | None = None) -> None:
        if num_layers < 1 or dim < 1 or chunk_tokens < 1:
            raise ValueError(f"need num_layers, dim, chunk_tokens ≥ 1, got "
                             f"{num_layers}, {dim}, {chunk_tokens}")
        if matmul_dtype not in (torch.float64, torch.float32):
            raise ValueError(f"matmul_dtype must be torch.float64 or torch.float32, "
                             f"got {matmul_dtype}")
        self.matmul_dtype = matmul_dtype
        self.layers = tuple(range(num_layers)) if layers is None else tuple(int(x) for x in layers)
        if len(self.layers) != num_layers:
            raise ValueError(f"{len(self.layers)} layer labels for num_layers={num_layers}")
        self.num_layers, self.dim, self.chunk_tokens = num_layers, dim, chunk_tokens
        self.device = None if device is None else torch.device(device)
        self.n_tokens = self.n_seen = 0
        if reference is not None and tuple(reference.shape) != (num_layers, dim):
            raise ValueError(f"reference must be (L={num_layers}, d={dim}), "
                             f"got {tuple(reference.shape)}")
        # (L, d) shift applied to every token; None: the first chunk's mean
        self._reference = None if reference is None else reference.to(torch.float64)
        self._finalized = False

    @staticmethod
    def accumulator_bytes(num_layers: int, dim: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
        """Bytes the float64 accumulators and one working chunk take (see ``_allocate``)."""
        L, d = num_layers, dim
        return 8 * (L * (L + 1) // 2 * d * d + L * L * d + L * d + L * L + L + chunk_tokens * L * d)

    def _allocate(self, device: torch.device) -> None:
        L, d, f64 = self.num_layers, self.dim, torch.float64
        self.device = device
        self._sums, self._sq_sums, self._sq_products, self._sq_weighted = moment_sums(L, d, device)
        self._cross = {(a, b): torch.zeros(d, d, dtype=f64, device=device)
                       for a in range(L) for b in range(a, L)}
        if self._reference is not None:
            self._reference = self._reference.to(device)

    def partial_sums(self) -> list[Tensor]:
        """The float64 accumulators, in a fixed order, for adding in place the sums of other
        streams over disjoint tokens with the same reference (allocated if still empty)."""
        if self._finalized:
            raise RuntimeError("finalize() already consumed this accumulator")
        if not hasattr(self, "_cross"):
            self._allocate(self.device or torch.device("cpu"))
        return [self._sums, self._sq_sums, self._sq_products, self._sq_weighted,
                *self._cross.values()]

    def update(self, hidden: Tensor, keep: Tensor | None = None) -> None:
        """Add tokens ``hidden: (L, n, d)`` (any float dtype), optionally only ``keep: (n,)``."""
        if self._finalized:
            raise RuntimeError("finalize() already consumed this accumulator")
        kept = kept_tokens(hidden, keep, self.num_layers, self.dim)
        self.n_seen += hidden.shape[1]
        if not hasattr(self, "_cross"):  # first call: accumulators on the given/input device
            self._allocate(self.device or kept.device)
        for start in range(0, kept.shape[1], self.chunk_tokens):
            self._accumulate(kept[:, start:start + self.chunk_tokens])

    def _accumulate(self, chunk: Tensor) -> None:
        x = chunk.to(device=self.device, dtype=torch.float64, copy=True)  # (L, m, d), own copy
        raw_sums = x.sum(dim=1)  # (L, d)
        _check_layers_finite(raw_sums, self.layers)
        if self._reference is None:
            self._reference = raw_sums / x.shape[1]  # (L, d)
        x -= self._reference[:, None, :]
        if self.matmul_dtype == torch.float64:
            for (a, b), cross in self._cross.items():
                cross.addmm_(x[a].T, x[b])
        else:
            low = x.to(self.matmul_dtype)
            for (a, b), cross in self._cross.items():
                cross += (low[a].T @ low[b]).to(torch.float64)
        add_moments((self._sums, self._sq_sums, self._sq_products, self._sq_weighted), x)
        self.n_tokens += x.shape[1]

    def _centred_row_norm_products(self, mean: Tensor) -> Tensor:
        """(L, L) Σᵢ ‖x_a,ᵢ − μ_a‖² ‖x_b,ᵢ − μ_b‖², ``mean: (L, d)``; call after the blocks
        are centred (``centred_row_norm_products``)."""
        bilinear = torch.zeros_like(self._sq_products)  # μ_aᵀ Σ_ab μ_b
        for (a, b), cov in self._cross.items():
            bilinear[a, b] = bilinear[b, a] = mean[a] @ cov @ mean[b]
        return centred_row_norm_products(self._sq_products, self._sq_weighted, self._sq_sums,
                                         mean, bilinear, self.n_tokens)

    def finalize(self) -> LayerStats:
        """Centre the accumulators and compute entropies and both CKA matrices."""
        n = self.n_tokens
        if n < MIN_TOKENS_DEBIASED:
            raise ValueError(f"only {n} tokens accumulated; at least {MIN_TOKENS_DEBIASED} "
                             "are needed (debiased CKA)")
        self._finalized = True
        for (a, b), cross in self._cross.items():  # in place: Σ_ab = Σxxᵀ − (Σx)(Σx)ᵀ/n
            cross.sub_(torch.outer(self._sums[a], self._sums[b]) / n)
        frob_sq = torch.zeros_like(self._sq_products)  # ‖Σ_ab‖²_F
        for (a, b), cov in self._cross.items():
            frob_sq[a, b] = frob_sq[b, a] = cov.square().sum()
        traces = torch.stack([self._cross[(a, a)].trace() for a in range(self.num_layers)])
        row_products = self._centred_row_norm_products(self._sums / n)
        own = [self._cross[(a, a)] for a in range(self.num_layers)]
        labels = self.layers
        return LayerStats(
            layers=labels, n_tokens=n, dim=self.dim, n_seen=self.n_seen,
            entropy=torch.stack([entropy_from_cov(c, 1.0) for c in own]),
            renyi2=torch.stack([entropy_from_cov(c, 2.0) for c in own]),
            cka=cka_from_moments(frob_sq, row_products, traces, n, debiased=True),
            cka_biased=cka_from_moments(frob_sq, row_products, traces, n, debiased=False),
            cov={(labels[a], labels[b]): cov for (a, b), cov in self._cross.items()})


def layer_stats(hidden: Tensor, keep: Tensor | None = None, *,
                layers: Sequence[int] | None = None) -> LayerStats:
    """One-shot ``LayerStats`` of ``hidden: (L, n, d)`` (a single streaming pass)."""
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be (L, n, d), got {tuple(hidden.shape)}")
    stream = StreamingLayerStats(hidden.shape[0], hidden.shape[2], hidden.device, layers=layers)
    stream.update(hidden, keep)
    return stream.finalize()


# ----------------------------------------------------------------------------- aggregates
def aggregate_entropy(stats: LayerStats, layers: Sequence[int], alpha: float = 1.0) -> float:
    """Matrix entropy (nats) of the concatenation [h_a; h_b; …] of ``layers`` (indices).

    Each layer is centred and scaled to unit trace (tr Σ_aa = 1) so none dominates by scale;
    the (k·d)² covariance is assembled from the stored blocks, Σ_ab / √(tr Σ_aa tr Σ_bb).
    """
    alpha = _check_alpha(alpha)
    layers = [int(layer) for layer in layers]
    if not layers:
        raise ValueError("aggregate_entropy needs at least one layer")
    stats.rows(layers)  # validates the indices
    scales = [stats.block(a, a).trace().sqrt() for a in layers]
    joint = torch.cat([torch.cat([stats.block(a, b) / (scales[i] * scales[j])
                                  for j, b in enumerate(layers)], dim=1)
                       for i, a in enumerate(layers)], dim=0)  # (k·d, k·d)
    return float(entropy_from_cov(joint, alpha))


def aggregate_renyi2(stats: LayerStats, subsets: Tensor) -> Tensor:
    """Rényi-2 entropy (nats) of concatenated, unit-trace layers for ``subsets: (S, k)``.

    Closed form, O(k²) per subset: exp(−H₂(S)) = Σp² = ‖Σ_S‖²_F / k² and, with unit-trace
    blocks, ‖Σ_ab‖²_F / (t_a t_b) = CKA_ab √(P_a P_b), P_a = exp(−H₂(a)) = ‖Σ_aa‖²_F / t_a².
    This holds exactly for the BIASED CKA (the debiased one changes the numerator), so
    exp(−H₂(S)) = k⁻²[Σ_a P_a + 2Σ_{a<b} CKA_ab √(P_a P_b)]. Returns ``(S,)`` float64.
    """
    subsets = torch.as_tensor(subsets)
    if subsets.ndim != 2 or subsets.shape[1] < 1 or subsets.is_floating_point():
        raise ValueError(f"subsets must be an integer tensor (S, k), got "
                         f"{subsets.dtype} {tuple(subsets.shape)}")
    rows = stats.rows(subsets).to(stats.cka_biased.device)  # (S, k)
    weights = torch.exp(-stats.renyi2.to(torch.float64) / 2)[rows]  # √P_a, (S, k)
    cka = stats.cka_biased.to(torch.float64)[rows[:, :, None], rows[:, None, :]]  # (S, k, k)
    purity = torch.einsum("sa,sab,sb->s", weights, cka, weights) / subsets.shape[1] ** 2
    return -torch.log(purity)
