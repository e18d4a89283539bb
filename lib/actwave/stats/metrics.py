"""Matrix entropy, linear CKA and token-entropy filtering of hidden states (pure math).

Conventions (docs/METHODS.md §4, §7): Z is ``(n_tokens, d)``; rows are centred by the
token mean; all spectra and sums are float64. Matrix entropy uses the d×d covariance
ZᶜᵀZᶜ, which has the same non-zero spectrum as the n×n Gram ZᶜZᶜᵀ (Skean et al. 2025,
"Layer by Layer"). Linear CKA is Kornblith et al. 2019 in feature space; the debiased
variant replaces every HSIC by the Székely–Rizzo / Song et al. U-statistic, written, as in
Kornblith's CKA demo, in terms of ‖XᵀY‖², the row squared norms r and their sums.

The statistics of every layer at once (``LayerStats``, the streaming pass, aggregate
entropies of layer sets) are built from these in ``actwave.stats.layerstats``.

Everything here is device-agnostic: results live on the inputs' device.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

# Debiased HSIC needs n(n-3) > 0.
MIN_TOKENS_DEBIASED = 4


# ----------------------------------------------------------------------------- checks
def _check_alpha(alpha: float) -> float:
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ValueError(f"alpha must be a number > 0 (1 = Shannon, else Rényi), got {alpha!r}")
    return float(alpha)


def _check_matrix(Z: Tensor, name: str, min_tokens: int = 2) -> None:
    if not isinstance(Z, Tensor) or Z.ndim != 2:
        raise ValueError(f"{name} must be a 2-D tensor (n_tokens, d), got "
                         f"{getattr(Z, 'shape', type(Z))}")
    if Z.shape[0] < min_tokens:
        raise ValueError(f"{name} has {Z.shape[0]} tokens; at least {min_tokens} are needed")
    if not torch.isfinite(Z).all():
        raise ValueError(f"{name} contains NaN or inf values")


def _check_layers_finite(layer_sums: Tensor, layers: Sequence[int]) -> None:
    """Raise naming the first layer (index from ``layers``) whose token sums ``(L, d)`` are
    not finite: a NaN/inf anywhere in a layer reaches its float64 sum, and this is far
    cheaper than an elementwise check of the whole chunk."""
    finite_rows = torch.isfinite(layer_sums).all(dim=1)  # (L,)
    if not finite_rows.all():
        bad = int((~finite_rows).nonzero()[0])
        raise ValueError(f"hidden states of layer {layers[bad]} (row {bad}) contain NaN or inf")


def _centre(Z: Tensor) -> Tensor:
    """Float64 copy of ``Z: (n, d)`` with the token mean removed."""
    Z = Z.to(torch.float64)
    return Z - Z.mean(dim=0, keepdim=True)


# ----------------------------------------------------------------------------- entropy
def entropy_from_cov(cov: Tensor, alpha: float = 1.0, n: int | None = None,
                     normalize: bool = False) -> Tensor:
    """Matrix entropy (nats) of a covariance ``cov: (d, d)``.

    p = eigvals / trace (eigenvalues at round-off level set to 0); α = 1: −Σ p log p
    (0·log 0 = 0); else Rényi log(Σ p^α) / (1 − α). ``normalize`` divides by log min(n, d), the maximum, so the
    result lies in [0, 1]; it needs the token count ``n``.
    """
    alpha = _check_alpha(alpha)
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"cov must be square (d, d), got {tuple(cov.shape)}")
    eigvals = torch.linalg.eigvalsh(cov.to(torch.float64))
    # Round-off eigenvalues (below the matrix_rank tolerance d·eps·λ_max) count as 0: they
    # would otherwise add spurious mass to Rényi entropies with α < 1.
    tolerance = eigvals.max().clamp(min=0) * cov.shape[0] * torch.finfo(torch.float64).eps
    eigvals = torch.where(eigvals > tolerance, eigvals, torch.zeros_like(eigvals))
    total = eigvals.sum()
    if not total > 0:
        raise ValueError("covariance has zero trace: all tokens are identical")
    probs = eigvals / total
    if alpha == 1.0:
        entropy = -torch.special.xlogy(probs, probs).sum()
    else:
        entropy = torch.log(probs.pow(alpha).sum()) / (1.0 - alpha)
    if not normalize:
        return entropy
    if n is None:
        raise ValueError("normalize=True needs the token count n (bound log min(n, d))")
    rank_bound = min(int(n), cov.shape[0])
    if rank_bound < 2:
        raise ValueError(f"cannot normalise: log min(n={n}, d={cov.shape[0]}) is 0")
    return entropy / math.log(rank_bound)


def top_eigen_share(cov: Tensor) -> float:
    """λ_max / Σλ of a covariance ``cov: (d, d)`` (eigenvalues clamped at 0), in (0, 1].

    Near 1 when one direction carries the variance, as outlier (massive-activation)
    dimensions do; 1/d for an isotropic covariance.
    """
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"cov must be square (d, d), got {tuple(cov.shape)}")
    eigvals = torch.linalg.eigvalsh(cov.to(torch.float64)).clamp(min=0)
    total = eigvals.sum()
    if not total > 0:
        raise ValueError("covariance has zero trace: all tokens are identical")
    return float(eigvals[-1] / total)


def unit_rows(hidden: Tensor) -> Tensor:
    """``hidden: (..., d)`` in float32 with every token vector scaled to unit L2 norm.

    The row-normalised variant of the statistics (as Skean et al. 2025 do): a token's
    overall scale, e.g. a massive activation, no longer weighs in. Zero rows stay zero.
    """
    return torch.nn.functional.normalize(hidden.to(torch.float32), dim=-1)


def matrix_entropy(Z: Tensor, alpha: float = 1.0, normalize: bool = False) -> Tensor:
    """Matrix entropy (nats) of ``Z: (n_tokens, d)``, tokens centred; see ``entropy_from_cov``."""
    _check_matrix(Z, "Z")
    Zc = _centre(Z)
    return entropy_from_cov(Zc.T @ Zc, alpha, n=Z.shape[0], normalize=normalize)


# ----------------------------------------------------------------------------- CKA
def _unbiased_hsic(xty: Tensor, rx_dot_ry: Tensor, sum_rx: Tensor, sum_ry: Tensor,
                   n: int) -> Tensor:
    """n(n−3)·HSIC₁ for linear kernels on centred features (Song et al. 2012).

    With K = XXᵀ, L = YYᵀ (centred, so K1 = 0) and zeroed diagonals, the U-statistic
    tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1/((n−1)(n−2)) − 2/(n−2)·1ᵀK̃L̃1 reduces to
    ‖XᵀY‖² − n/(n−2)·r_x·r_y + (Σr_x)(Σr_y)/((n−1)(n−2)), r = row squared norms.
    Works elementwise on tensors of pair statistics.
    """
    return (xty - n / (n - 2.0) * rx_dot_ry
            + sum_rx * sum_ry / ((n - 1.0) * (n - 2.0)))


def _check_varying(self_x: Tensor, self_y: Tensor) -> None:
    """CKA divides by ‖XᵀX‖·‖YᵀY‖: zero when a side is constant over the tokens (0/0 = NaN)."""
    for name, value in (("X", self_x), ("Y", self_y)):
        if not float(value) > 0:
            raise ValueError(f"{name} is constant over the tokens (no variance in any feature): "
                             "CKA is undefined for it")


def _cka_ratio(cross: Tensor, self_x: Tensor, self_y: Tensor) -> Tensor:
    return cross / torch.sqrt(self_x * self_y)


def _feature_moments(Xc: Tensor, Yc: Tensor) -> dict[str, Tensor]:
    """‖XᵀY‖², ‖XᵀX‖², ‖YᵀY‖² and the row-norm terms of centred ``(n, d)`` matrices."""
    rx, ry = Xc.square().sum(1), Yc.square().sum(1)  # (n,), (n,)
    return {"xy": (Xc.T @ Yc).square().sum(), "xx": (Xc.T @ Xc).square().sum(),
            "yy": (Yc.T @ Yc).square().sum(), "rx": rx, "ry": ry}


def _unbiased_hsic_triplet(moments: dict[str, Tensor],
                           n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Unbiased (xy, xx, yy) HSICs from ``_feature_moments``."""
    rx, ry = moments["rx"], moments["ry"]
    return (_unbiased_hsic(moments["xy"], rx @ ry, rx.sum(), ry.sum(), n),
            _unbiased_hsic(moments["xx"], rx @ rx, rx.sum(), rx.sum(), n),
            _unbiased_hsic(moments["yy"], ry @ ry, ry.sum(), ry.sum(), n))


def cka_from_moments(frob_sq: Tensor, row_products: Tensor, traces: Tensor, n: int,
                     debiased: bool = True) -> Tensor:
    """``(L, L)`` linear CKA of L centred layers from their pair moments.

    ``frob_sq[a, b]`` = ‖X_aᵀX_b‖²_F, ``row_products[a, b]`` = Σᵢ‖x_a,ᵢ‖²‖x_b,ᵢ‖² and
    ``traces[a]`` = Σᵢ‖x_a,ᵢ‖² (all float64, rows centred); n tokens. Biased: the ratio of
    the ‖XᵀY‖² terms; debiased: of the unbiased HSICs (``_unbiased_hsic``).
    """
    if debiased:
        frob_sq = _unbiased_hsic(frob_sq, row_products, traces[:, None], traces[None, :], n)
    diagonal = frob_sq.diagonal()
    return _cka_ratio(frob_sq, diagonal[:, None], diagonal[None, :])


def linear_cka_matrix(hidden: Tensor, debiased: bool = True, block_rows: int = 256) -> Tensor:
    """``(L, L)`` linear CKA between all layers of ``hidden: (L, n, d)``, Gram route.

    ‖X_aᵀX_b‖²_F = ⟨K_a, K_b⟩_F with K_a = X_aᶜX_aᶜᵀ (n×n): a row block of every K at a
    time, stacked as ``(L, block_rows·n)``, adds its Gram to the L×L sums, so memory is
    L·block_rows·n and cost L·n²·d + L²·n², cheaper than the feature route's L²·n·d² when
    n < d·L/2 (e.g. a 3000-token subsample of 31 layers × 576). Gram products in the input
    precision (float32 states: relative error ~1e-6), sums float64.
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be (L, n, d), got {tuple(hidden.shape)}")
    if hidden.shape[1] < MIN_TOKENS_DEBIASED or not torch.isfinite(hidden).all():
        raise ValueError(f"hidden needs ≥ {MIN_TOKENS_DEBIASED} tokens and finite values, got "
                         f"{hidden.shape[1]} tokens")
    centred = hidden - hidden.mean(dim=1, keepdim=True)  # (L, n, d)
    n = centred.shape[1]
    frob_sq = torch.zeros(len(centred), len(centred), dtype=torch.float64, device=hidden.device)
    for start in range(0, n, block_rows):
        rows = centred[:, start:start + block_rows] @ centred.transpose(1, 2)  # (L, b, n)
        flat = rows.reshape(len(centred), -1).to(torch.float64)
        frob_sq += flat @ flat.T
    norms = centred.square().sum(dim=2).to(torch.float64)  # (L, n) row squared norms
    for layer, value in enumerate(frob_sq.diagonal()):
        if not float(value) > 0:
            raise ValueError(f"layer row {layer} is constant over the tokens: CKA undefined")
    return cka_from_moments(frob_sq, norms @ norms.T, norms.sum(dim=1), n, debiased)


def _check_pair(X: Tensor, Y: Tensor, min_tokens: int) -> None:
    _check_matrix(X, "X", min_tokens)
    _check_matrix(Y, "Y", min_tokens)
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X and Y must have the same number of tokens, got "
                         f"{X.shape[0]} and {Y.shape[0]}")


def linear_cka(X: Tensor, Y: Tensor, debiased: bool = False) -> Tensor:
    """Linear CKA of ``X: (n, d1)`` and ``Y: (n, d2)`` (Kornblith et al. 2019), float64.

    Biased: ‖YᶜᵀXᶜ‖²_F / (‖XᶜᵀXᶜ‖_F ‖YᶜᵀYᶜ‖_F), columns centred. Debiased: each of the
    three HSICs replaced by the unbiased U-statistic (needs n ≥ 4); it removes the positive
    floor biased CKA has for unrelated features at small n.
    """
    _check_pair(X, Y, MIN_TOKENS_DEBIASED if debiased else 2)
    moments = _feature_moments(_centre(X), _centre(Y))
    _check_varying(moments["xx"], moments["yy"])
    if not debiased:
        return _cka_ratio(moments["xy"], moments["xx"], moments["yy"])
    return _cka_ratio(*_unbiased_hsic_triplet(moments, X.shape[0]))


def minibatch_cka(batches: Iterable[tuple[Tensor, Tensor]]) -> Tensor:
    """Minibatch CKA (Nguyen, Raghu & Kornblith 2021) over ``(X_b: (n_b, d1), Y_b: (n_b, d2))``.

    Averages the unbiased HSIC₁ of every minibatch (each scaled by 1/(n_b(n_b−3)), so
    batches may differ in size), then forms the CKA ratio of the averages. Memory does not
    grow with the total token count.
    """
    totals = None
    for X, Y in batches:
        _check_pair(X, Y, MIN_TOKENS_DEBIASED)
        n = X.shape[0]
        moments = _feature_moments(_centre(X), _centre(Y))
        hsics = torch.stack(_unbiased_hsic_triplet(moments, n)) / (n * (n - 3.0))
        totals = hsics if totals is None else totals + hsics
    if totals is None:
        raise ValueError("minibatch_cka got no batches")
    _check_varying(totals[1], totals[2])
    return _cka_ratio(totals[0], totals[1], totals[2])


# ----------------------------------------------------------------------------- tokens
def entropy_and_argmax_of_logits(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Predictive entropy H(softmax(z)) in nats (fp32) and argmax of ``logits: (..., V)``
    -> ``((...), (...))``.

    With s = z − max z and w = exp(s): H = log Σw − Σ w·s / Σw. One pass for max and
    argmax, one exp, no normalised copy; the shift keeps both terms small, so in float32 it
    stays within ~1e-6 nats of a float64 evaluation, where logsumexp(z) − Σ softmax(z)·z
    loses ~1e-4 to cancellation. −inf logits (masked vocabulary) weigh 0.
    """
    z = logits.to(torch.float32)
    top, argmax = z.max(dim=-1)
    shifted = (z - top.unsqueeze(-1)).clamp_min_(torch.finfo(torch.float32).min)  # no 0·(−inf)
    weights = shifted.exp()
    total = weights.sum(dim=-1)
    return total.log() - torch.linalg.vecdot(weights, shifted) / total, argmax


def token_entropy(logits: Tensor) -> Tensor:
    """Predictive entropy in nats (fp32) of ``logits: (..., V)`` -> ``(...)``; see
    ``entropy_and_argmax_of_logits``."""
    return entropy_and_argmax_of_logits(logits)[0]


def quantile_threshold(entropy: Tensor, quantile: float) -> Tensor:
    """Entropy value t such that keeping ``entropy ≥ t`` keeps the top (1 − q) share.

    t = the ⌈q(n−1)⌉-th smallest value (order statistic, no interpolation, so ties are
    kept together); sort-based, so there is no size limit as with ``torch.quantile``.
    """
    if not 0.0 <= quantile < 1.0:
        raise ValueError(f"quantile must be in [0, 1), got {quantile!r}")
    if entropy.ndim != 1 or entropy.numel() == 0:
        raise ValueError(f"entropy must be a non-empty 1-D tensor, got {tuple(entropy.shape)}")
    ordered = entropy.sort().values
    return ordered[math.ceil(quantile * (entropy.numel() - 1))]


def token_filter(entropy: Tensor, *, threshold: float | None = None,
                 quantile: float | None = None, special: Tensor | None = None,
                 exclude_special: bool = True) -> Tensor:
    """Keep mask ``(n,)`` bool over tokens with predictive ``entropy: (n,)``.

    ``threshold``: keep entropy ≥ threshold. ``quantile`` q: keep entropy ≥ the q-quantile
    of the candidate tokens (q = 0.5 keeps the top half), see ``quantile_threshold``.
    Neither: keep all. Special tokens (``special: (n,)`` bool) are dropped first when
    ``exclude_special`` and are not counted in the quantile.
    """
    if entropy.ndim != 1:
        raise ValueError(f"entropy must be 1-D (n_tokens,), got {tuple(entropy.shape)}")
    if threshold is not None and quantile is not None:
        raise ValueError("give at most one of threshold and quantile, not both")
    if torch.isnan(entropy).any():
        raise ValueError("entropy contains NaN")
    keep = torch.ones_like(entropy, dtype=torch.bool)
    if special is not None and exclude_special:
        if special.shape != entropy.shape or special.dtype != torch.bool:
            raise ValueError(f"special must be a bool tensor of shape {tuple(entropy.shape)}, "
                             f"got {special.dtype} {tuple(special.shape)}")
        keep &= ~special
    if quantile is not None:
        threshold = quantile_threshold(entropy[keep], quantile)
    if threshold is not None:
        keep &= entropy >= threshold
    return keep


# ----------------------------------------------------------------------------- compartments
def compartments(cka: Tensor, max_blocks: int | None = None,
                 resolution: float = 1.0) -> list[tuple[int, int]]:
    """Contiguous blocks of mutually similar layers: ``[(first_row, last_row), …]`` inclusive.

    Objective: Newman's modularity with the CKA matrix as weighted graph (negatives clipped
    to 0, diagonal dropped), Q = Σ_blocks Σ_{i,j ∈ block} [W_ij − γ k_i k_j / 2m], k = row
    sums, 2m = Σk, γ = ``resolution`` (larger → more, smaller blocks). It rewards a block
    when its layers are more similar than their overall similarity predicts. Blocks must be
    contiguous in depth, so the exact optimum over all segmentations with ≤ ``max_blocks``
    blocks is found by dynamic programming, O(L²·K). Number of blocks: the one maximising
    Q (no separate elbow rule); ties go to fewer blocks and earlier cuts (deterministic).
    """
    cka = torch.as_tensor(cka)
    if cka.ndim != 2 or cka.shape[0] != cka.shape[1]:
        raise ValueError(f"cka must be a square (L, L) matrix, got {tuple(cka.shape)}")
    if not torch.isfinite(cka).all():
        raise ValueError("cka contains NaN or inf")
    n_rows = cka.shape[0]
    max_blocks = n_rows if max_blocks is None else int(max_blocks)
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be ≥ 1, got {max_blocks}")
    weights = cka.detach().to("cpu", torch.float64).clamp(min=0)
    weights = (weights + weights.T) / 2
    weights.fill_diagonal_(0)
    degree, total = weights.sum(dim=1), weights.sum()
    if n_rows == 1 or not total > 0:
        return [(0, n_rows - 1)]
    gain = weights - resolution * torch.outer(degree, degree) / total  # modularity matrix
    prefix = torch.zeros(n_rows + 1, n_rows + 1, dtype=torch.float64)
    prefix[1:, 1:] = gain.cumsum(0).cumsum(1)  # 2-D prefix sums: any block sum in O(1)
    table = prefix.tolist()

    def segment(first: int, last: int) -> float:
        """Σ of the modularity matrix over rows and columns first..last."""
        return (table[last + 1][last + 1] - table[first][last + 1]
                - table[last + 1][first] + table[first][first])
    return _best_segmentation(segment, n_rows, min(max_blocks, n_rows))


def _best_segmentation(segment: Callable[[int, int], float], n_rows: int,
                       max_blocks: int) -> list[tuple[int, int]]:
    """Exact DP: best[k][e] = max score of rows 0..e cut into k contiguous segments."""
    neg = -math.inf
    best = [[neg] * n_rows for _ in range(max_blocks + 1)]
    start = [[0] * n_rows for _ in range(max_blocks + 1)]
    for end in range(n_rows):
        best[1][end] = segment(0, end)
    for k in range(2, max_blocks + 1):
        for end in range(k - 1, n_rows):
            for first in range(k - 1, end + 1):
                score = best[k - 1][first - 1] + segment(first, end)
                if score > best[k][end] + 1e-12:  # strict: ties keep the earlier cut
                    best[k][end], start[k][end] = score, first
    n_blocks = max(range(1, max_blocks + 1), key=lambda k: (round(best[k][-1], 12), -k))
    blocks, end = [], n_rows - 1
    for k in range(n_blocks, 0, -1):
        first = start[k][end] if k > 1 else 0
        blocks.append((first, end))
        end = first - 1
    return blocks[::-1]
