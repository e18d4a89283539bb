"""actwave.stats.metrics against independent routes (numpy Gram space, Kornblith's demo
formulas)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actwave.stats import layerstats as LS
from actwave.stats import metrics as M


# ----------------------------------------------------------------------------- references
def gram_entropy_np(Z: np.ndarray, alpha: float) -> float:
    """Entropy from the n×n Gram of the centred tokens (the route metrics.py avoids)."""
    Zc = Z - Z.mean(axis=0)
    eig = np.linalg.eigvalsh(Zc @ Zc.T)
    eig[eig <= eig.max() * len(eig) * np.finfo(float).eps] = 0  # numpy's matrix_rank tolerance
    p = eig / eig.sum()
    p = p[p > 0]
    if alpha == 1:
        return float(-(p * np.log(p)).sum())
    return float(np.log((p ** alpha).sum()) / (1 - alpha))


def centring_matrix(n: int) -> np.ndarray:
    return np.eye(n) - np.ones((n, n)) / n


def hsic_biased_np(K: np.ndarray, L: np.ndarray) -> float:
    """tr(KHLH) (scale dropped: it cancels in CKA)."""
    H = centring_matrix(K.shape[0])
    return float(np.trace(K @ H @ L @ H))


def hsic_unbiased_song_np(K: np.ndarray, L: np.ndarray) -> float:
    """Song et al. 2012 unbiased HSIC₁ on Grams with zeroed diagonals."""
    n = K.shape[0]
    Kt, Lt = K.copy(), L.copy()
    np.fill_diagonal(Kt, 0)
    np.fill_diagonal(Lt, 0)
    one = np.ones(n)
    value = (np.trace(Kt @ Lt) + (one @ Kt @ one) * (one @ Lt @ one) / ((n - 1) * (n - 2))
             - 2 / (n - 2) * (one @ Kt @ Lt @ one))
    return float(value / (n * (n - 3)))


def cka_gram_np(X: np.ndarray, Y: np.ndarray, debiased: bool) -> float:
    """CKA in Gram space (uncentred linear kernels), via HSIC with H or the U-statistic."""
    K, L = X @ X.T, Y @ Y.T
    hsic = hsic_unbiased_song_np if debiased else hsic_biased_np
    return hsic(K, L) / math.sqrt(hsic(K, K) * hsic(L, L))


def kornblith_centre_gram(gram: np.ndarray, unbiased: bool) -> np.ndarray:
    """Gram centring as published in Kornblith et al.'s CKA demo (own transcription).

    Biased: H K H. Unbiased (Székely–Rizzo U-centring): zero diagonal, column means over
    n−2, corrected by their total over 2(n−1), subtracted from rows and columns, diagonal
    zeroed again.
    """
    gram = gram.astype(np.float64).copy()
    n = gram.shape[0]
    if not unbiased:
        H = centring_matrix(n)
        return H @ gram @ H
    np.fill_diagonal(gram, 0)
    col_means = gram.sum(axis=0) / (n - 2)
    col_means -= col_means.sum() / (2 * (n - 1))
    gram -= col_means[:, None]
    gram -= col_means[None, :]
    np.fill_diagonal(gram, 0)
    return gram


def kornblith_cka_np(X: np.ndarray, Y: np.ndarray, debiased: bool) -> float:
    """cka(gram_linear(X), gram_linear(Y), debiased) of the demo: ⟨K̃,L̃⟩/(‖K̃‖‖L̃‖)."""
    Kc = kornblith_centre_gram(X @ X.T, debiased)
    Lc = kornblith_centre_gram(Y @ Y.T, debiased)
    return float((Kc * Lc).sum() / (np.linalg.norm(Kc) * np.linalg.norm(Lc)))


def related_pair(n: int, d1: int, d2: int, seed: int, noise: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d1, generator=g, dtype=torch.float64) + 3.0
    Y = X @ torch.randn(d1, d2, generator=g, dtype=torch.float64) \
        + noise * torch.randn(n, d2, generator=g, dtype=torch.float64)
    return X, Y


def synthetic_layers(L: int = 4, n: int = 240, d: int = 12, seed: int = 0,
                     offset: float = 1e3) -> torch.Tensor:
    """(L, n, d) correlated layers with a large common mean, like residual streams."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=torch.float64)
    layers = []
    for layer in range(L):
        mix = torch.randn(d, d, generator=g, dtype=torch.float64)
        noise = torch.randn(n, d, generator=g, dtype=torch.float64)
        layers.append(base @ mix * (layer + 1) + layer * noise + offset)
    return torch.stack(layers)


def unit_trace_concat(hidden: torch.Tensor, rows) -> torch.Tensor:
    """[Z_a; Z_b; …] with each layer centred and scaled to unit Frobenius norm."""
    parts = []
    for row in rows:
        Zc = hidden[row] - hidden[row].mean(0)
        parts.append(Zc / Zc.norm())
    return torch.cat(parts, dim=1)


# ----------------------------------------------------------------------------- entropy
@pytest.mark.parametrize("n,d", [(30, 12), (10, 40)])
@pytest.mark.parametrize("alpha", [1.0, 2.0, 0.5])
def test_entropy_cov_route_equals_gram_route(n, d, alpha):
    Z = torch.randn(n, d, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * \
        torch.linspace(0.1, 3.0, d, dtype=torch.float64)
    assert float(M.matrix_entropy(Z, alpha)) == pytest.approx(gram_entropy_np(Z.numpy(), alpha),
                                                              abs=1e-9)


def test_entropy_bounds_and_normalisation():
    g = torch.Generator().manual_seed(1)
    iso = torch.randn(20000, 8, generator=g, dtype=torch.float64)
    assert float(M.matrix_entropy(iso, normalize=True)) == pytest.approx(1.0, abs=1e-3)
    rank_one = torch.randn(50, 1, generator=g, dtype=torch.float64) @ \
        torch.randn(1, 8, generator=g, dtype=torch.float64)
    assert float(M.matrix_entropy(rank_one)) == pytest.approx(0.0, abs=1e-9)
    few = torch.randn(5, 8, generator=g, dtype=torch.float64)  # rank ≤ n − 1 = 4 after centring
    assert float(M.matrix_entropy(few)) <= math.log(4) + 1e-9


def test_entropy_invariant_to_rotation_scale_and_shift():
    Z = torch.randn(60, 10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    Z = Z * torch.arange(1, 11, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(10, 10, generator=torch.Generator().manual_seed(3),
                                       dtype=torch.float64))
    reference = float(M.matrix_entropy(Z))
    assert float(M.matrix_entropy(5.0 * Z @ Q + 7.0)) == pytest.approx(reference, abs=1e-10)
    assert float(M.matrix_entropy(Z, 2.0)) < reference  # Rényi decreasing in α


def test_entropy_from_cov_needs_n_to_normalise():
    with pytest.raises(ValueError, match="token count"):
        M.entropy_from_cov(torch.eye(3, dtype=torch.float64), normalize=True)


# ----------------------------------------------------------------------------- CKA
@pytest.mark.parametrize("n,d1,d2", [(40, 6, 9), (12, 30, 25)])
@pytest.mark.parametrize("debiased", [False, True])
def test_cka_feature_space_equals_gram_space(n, d1, d2, debiased):
    X, Y = related_pair(n, d1, d2, seed=n + d1)
    expected = cka_gram_np(X.numpy(), Y.numpy(), debiased)
    assert float(M.linear_cka(X, Y, debiased)) == pytest.approx(expected, abs=1e-10)


@pytest.mark.parametrize("debiased", [False, True])
def test_cka_matches_kornblith_demo_formulas(debiased):
    X, Y = related_pair(50, 20, 7, seed=4, noise=2.0)
    expected = kornblith_cka_np(X.numpy(), Y.numpy(), debiased)
    assert float(M.linear_cka(X, Y, debiased)) == pytest.approx(expected, abs=1e-10)
    assert 0.05 < expected < 0.99  # a non-trivial value, not a degenerate 0 or 1


def test_debiased_cka_removes_small_n_floor():
    g = torch.Generator().manual_seed(5)
    biased, debiased = [], []
    for _ in range(5):
        X = torch.randn(40, 500, generator=g, dtype=torch.float64)
        Y = torch.randn(40, 500, generator=g, dtype=torch.float64)
        biased.append(float(M.linear_cka(X, Y)))
        debiased.append(float(M.linear_cka(X, Y, debiased=True)))
    assert min(biased) > 0.5
    assert max(abs(v) for v in debiased) < 0.15 and abs(np.mean(debiased)) < 0.04


@pytest.mark.parametrize("debiased", [False, True])
def test_cka_invariances(debiased):
    X, Y = related_pair(45, 8, 8, seed=6)
    Q, _ = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(7),
                                       dtype=torch.float64))
    reference = float(M.linear_cka(X, Y, debiased))
    assert float(M.linear_cka(X @ Q, 3.5 * Y, debiased)) == pytest.approx(reference, abs=1e-10)
    assert float(M.linear_cka(X, X * 2 + 1, debiased)) == pytest.approx(1.0, abs=1e-10)
    assert float(M.linear_cka(Y, X, debiased)) == pytest.approx(reference, abs=1e-12)
    # not invariant to a non-isotropic scaling: the check above could fail
    stretched = X * torch.linspace(0.1, 10, 8, dtype=torch.float64)
    assert abs(float(M.linear_cka(stretched, Y, debiased)) - reference) > 1e-3


def test_minibatch_cka_single_batch_and_average():
    X, Y = related_pair(60, 10, 6, seed=8)
    single = M.minibatch_cka([(X, Y)])
    assert float(single) == pytest.approx(float(M.linear_cka(X, Y, debiased=True)), abs=1e-12)
    batches = [(X[:25], Y[:25]), (X[25:], Y[25:])]
    hsic = lambda a, b: np.mean([hsic_unbiased_song_np(x.numpy() @ x.numpy().T,  # noqa: E731
                                                       y.numpy() @ y.numpy().T)
                                 for x, y in zip(a, b)])
    xs, ys = [b[0] for b in batches], [b[1] for b in batches]
    expected = hsic(xs, ys) / math.sqrt(hsic(xs, xs) * hsic(ys, ys))
    assert float(M.minibatch_cka(batches)) == pytest.approx(expected, abs=1e-10)


# ----------------------------------------------------------------------------- streaming
@pytest.fixture(scope="module")
def hidden():
    return synthetic_layers()


@pytest.fixture(scope="module")
def streamed(hidden):
    keep = torch.ones(hidden.shape[1], dtype=torch.bool)
    keep[::7] = False
    stream = LS.StreamingLayerStats(4, 12, chunk_tokens=33, layers=[0, 1, 2, 3])
    stream.update(hidden[:, :100], keep[:100])
    stream.update(hidden[:, 100:], keep[100:])
    return stream.finalize(), hidden[:, keep]


def test_streaming_equals_one_shot(streamed):
    stats, kept = streamed
    assert stats.n_tokens == kept.shape[1] and stats.n_seen == 240
    assert stats.kept_fraction == pytest.approx(kept.shape[1] / 240)
    for a in range(4):
        assert float(stats.entropy[a]) == pytest.approx(float(M.matrix_entropy(kept[a])), abs=1e-9)
        assert float(stats.renyi2[a]) == pytest.approx(float(M.matrix_entropy(kept[a], 2.0)),
                                                       abs=1e-9)
        for b in range(4):
            for debiased, matrix in ((True, stats.cka), (False, stats.cka_biased)):
                one_shot = float(M.linear_cka(kept[a], kept[b], debiased))
                assert float(matrix[a, b]) == pytest.approx(one_shot, abs=1e-9)
    assert not torch.allclose(stats.cka, stats.cka_biased)  # the two estimators differ here


def test_streaming_leaves_input_untouched_and_follows_device(hidden):
    before = hidden.clone()
    stats = LS.layer_stats(hidden)
    assert torch.equal(hidden, before)
    assert stats.cka.device == hidden.device and stats.cov[(0, 1)].dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streaming_on_cuda_matches_cpu(hidden):
    on_cpu = LS.layer_stats(hidden)
    on_gpu = LS.layer_stats(hidden.cuda())
    assert on_gpu.cka.is_cuda
    assert torch.allclose(on_gpu.cka.cpu(), on_cpu.cka, atol=1e-9)
    assert LS.aggregate_renyi2(on_gpu, torch.tensor([[0, 1]])).is_cuda


def test_streaming_float32_matmuls_stay_close(hidden):
    exact = LS.layer_stats(hidden)
    stream = LS.StreamingLayerStats(4, 12, matmul_dtype=torch.float32, chunk_tokens=50)
    stream.update(hidden)
    fast = stream.finalize()
    for name in ("entropy", "renyi2", "cka", "cka_biased"):
        assert torch.allclose(getattr(fast, name), getattr(exact, name), rtol=1e-5, atol=1e-5)
    assert not torch.equal(fast.cka, exact.cka)  # the float32 path really ran


def test_streaming_covariance_blocks_are_centred_cross_products(streamed):
    stats, kept = streamed
    Xc, Yc = (kept[i] - kept[i].mean(0) for i in (1, 3))
    assert torch.allclose(stats.cov[(1, 3)], Xc.T @ Yc, atol=1e-6, rtol=1e-9)
    assert torch.allclose(stats.block(3, 1), Yc.T @ Xc, atol=1e-6, rtol=1e-9)


@pytest.mark.parametrize("layers", [[0, 2], [1, 2, 3], [3]])
@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_aggregate_entropy_equals_entropy_of_concatenation(streamed, layers, alpha):
    stats, kept = streamed
    direct = float(M.matrix_entropy(unit_trace_concat(kept, layers), alpha))
    assert LS.aggregate_entropy(stats, layers, alpha) == pytest.approx(direct, abs=1e-8)


def test_aggregate_entropy_ignores_layer_scale(hidden):
    scaled = hidden.clone()
    scaled[0] = scaled[0] * 100
    plain, loud = LS.layer_stats(hidden), LS.layer_stats(scaled)
    assert LS.aggregate_entropy(loud, [0, 3]) == pytest.approx(LS.aggregate_entropy(plain, [0, 3]),
                                                             abs=1e-9)


def test_renyi2_identity_holds_with_biased_cka(streamed):
    stats, kept = streamed
    subsets = torch.tensor([[0, 1], [1, 1], [3, 2]])
    closed = LS.aggregate_renyi2(stats, subsets)
    for s, subset in enumerate(subsets.tolist()):
        direct = float(M.matrix_entropy(unit_trace_concat(kept, subset), 2.0))
        assert float(closed[s]) == pytest.approx(direct, abs=1e-9)
        assert float(closed[s]) == pytest.approx(LS.aggregate_entropy(stats, subset, 2.0), abs=1e-9)
    triples = torch.tensor([[0, 1, 2], [1, 2, 3]])
    direct = torch.tensor([LS.aggregate_entropy(stats, t, 2.0) for t in triples.tolist()],
                          dtype=torch.float64)
    assert torch.allclose(LS.aggregate_renyi2(stats, triples), direct, atol=1e-9)
    # with the debiased CKA in the formula the identity breaks
    swapped = LS.LayerStats(**{**stats.__dict__, "cka_biased": stats.cka})
    assert not torch.allclose(LS.aggregate_renyi2(swapped, triples), direct, atol=1e-6)


def test_layer_labels_map_to_rows(hidden):
    stats = LS.layer_stats(hidden[1:], layers=[5, 6, 7])
    assert stats.layers == (5, 6, 7) and set(stats.cov) == {(5, 5), (5, 6), (5, 7), (6, 6),
                                                            (6, 7), (7, 7)}
    assert LS.aggregate_entropy(stats, [5, 7]) == pytest.approx(
        float(M.matrix_entropy(unit_trace_concat(hidden, [1, 3]))), abs=1e-8)
    with pytest.raises(ValueError, match=r"layers \[0\] not in"):
        LS.aggregate_renyi2(stats, torch.tensor([[0, 5]]))


def test_to_dict_round_trip_and_without_cov(streamed):
    stats, _ = streamed
    back = LS.LayerStats.from_dict(stats.to_dict())
    assert back.layers == stats.layers and back.n_seen == stats.n_seen
    assert torch.equal(back.cka, stats.cka) and torch.equal(back.cov[(0, 2)], stats.cov[(0, 2)])
    light = stats.without_cov()
    assert torch.equal(light.entropy, stats.entropy) and stats.cov  # original untouched
    with pytest.raises(ValueError, match="no covariance blocks"):
        LS.aggregate_entropy(light, [0, 1])


# ----------------------------------------------------------------------------- tokens
def test_token_entropy_matches_direct_formula():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(9)) * 4
    probs = torch.softmax(logits.double(), -1)
    expected = -(probs * probs.log()).sum(-1)
    out = M.token_entropy(logits.to(torch.bfloat16).float())
    assert out.shape == (3, 5) and out.dtype == torch.float32
    assert torch.allclose(M.token_entropy(logits), expected.float(), atol=1e-5)
    assert float(M.token_entropy(torch.zeros(7))) == pytest.approx(math.log(7), abs=1e-6)
    masked = torch.tensor([0.0, 0.0, -math.inf])
    assert float(M.token_entropy(masked)) == pytest.approx(math.log(2), abs=1e-6)


def test_entropy_and_argmax_of_logits_is_float64_accurate_at_vocabulary_scale():
    """49k-way logits as peaked as a trained LM head's: the shifted float32 formula stays
    within 1e-5 nats of −Σ p log p in float64 (the logsumexp − Σ softmax·z route loses
    ~1e-4 here), and its argmax is torch's."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 49152, generator=g) * torch.linspace(0.5, 12, 64)[:, None]
    probs = torch.softmax(logits.double(), -1)
    expected = -torch.xlogy(probs, probs).sum(-1)
    entropy, argmax = M.entropy_and_argmax_of_logits(logits)
    assert entropy.dtype == torch.float32 and entropy.shape == (64,)
    assert float(expected.min()) < 0.5 < 8 < float(expected.max())  # spans peaked..flat
    assert float((entropy.double() - expected).abs().max()) < 1e-5
    assert torch.equal(argmax, logits.argmax(-1))


def test_token_filter_threshold_quantile_and_special():
    entropy = torch.tensor([0.1, 5.0, 2.0, 3.0, 0.5, 4.0, 9.0, 1.0])
    special = torch.tensor([False, False, False, False, False, False, True, False])
    assert M.token_filter(entropy).all()
    assert M.token_filter(entropy, threshold=2.0, special=special).tolist() == \
        [False, True, True, True, False, True, False, False]
    top_half = M.token_filter(entropy, quantile=0.5, special=special)
    # the median of the 7 candidates (2.0) is kept: ⌈q(n−1)⌉-th order statistic
    assert top_half.tolist() == [False, True, True, True, False, True, False, False]
    with_special = M.token_filter(entropy, quantile=0.5, special=special, exclude_special=False)
    assert with_special.sum() == 4 and with_special[6]
    ties = M.token_filter(torch.tensor([1.0, 1.0, 1.0, 2.0]), quantile=0.5)
    assert ties.all()  # ties at the threshold are kept together


def test_token_filter_errors():
    entropy = torch.rand(5)
    with pytest.raises(ValueError, match="at most one"):
        M.token_filter(entropy, threshold=1.0, quantile=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        M.token_filter(entropy, quantile=1.0)
    with pytest.raises(ValueError, match="special must be a bool"):
        M.token_filter(entropy, special=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaN"):
        M.token_filter(torch.tensor([0.1, math.nan]))


# ----------------------------------------------------------------------------- compartments
def block_cka(sizes, within=0.9, between=0.2, noise=0.03, seed=0) -> torch.Tensor:
    labels = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    same = labels[:, None] == labels[None, :]
    cka = torch.where(same, torch.tensor(within), torch.tensor(between)).double()
    g = torch.Generator().manual_seed(seed)
    jitter = noise * torch.rand(len(labels), len(labels), generator=g)
    cka = cka + (jitter + jitter.T) / 2
    cka.fill_diagonal_(1.0)
    return cka


def test_compartments_recover_blocks():
    assert M.compartments(block_cka([3, 5, 4])) == [(0, 2), (3, 7), (8, 11)]
    assert M.compartments(block_cka([2, 6, 2, 5], seed=1)) == [(0, 1), (2, 7), (8, 9), (10, 14)]
    assert M.compartments(block_cka([3, 5, 4]), max_blocks=1) == [(0, 11)]


def test_compartments_uniform_matrix_is_one_block_and_errors():
    flat = torch.full((6, 6), 0.7)
    assert M.compartments(flat) == [(0, 5)]
    with pytest.raises(ValueError, match="square"):
        M.compartments(torch.ones(3, 4))
    with pytest.raises(ValueError, match="max_blocks"):
        M.compartments(flat, max_blocks=0)


# ----------------------------------------------------------------------------- errors
def test_error_cases():
    with pytest.raises(ValueError, match="at least 2"):
        M.matrix_entropy(torch.randn(1, 4))
    with pytest.raises(ValueError, match="alpha"):
        M.matrix_entropy(torch.randn(5, 4), alpha=0)
    with pytest.raises(ValueError, match="alpha"):
        M.matrix_entropy(torch.randn(5, 4), alpha=-1.0)
    with pytest.raises(ValueError, match="same number of tokens"):
        M.linear_cka(torch.randn(6, 3), torch.randn(7, 3))
    with pytest.raises(ValueError, match="NaN"):
        M.linear_cka(torch.tensor([[1.0], [math.nan], [2.0]]), torch.randn(3, 1))
    with pytest.raises(ValueError, match="at least 4"):
        M.linear_cka(torch.randn(3, 2), torch.randn(3, 2), debiased=True)
    with pytest.raises(ValueError, match="identical"):
        M.matrix_entropy(torch.ones(5, 3))


def test_streaming_error_cases():
    hidden = torch.randn(3, 10, 4)
    hidden[2, 4, 1] = math.inf
    stream = LS.StreamingLayerStats(3, 4, layers=[0, 7, 9])
    with pytest.raises(ValueError, match="layer 9 "):
        stream.update(hidden)
    hidden[2, 4, 1], hidden[1, 0, 0] = 0.0, math.nan
    with pytest.raises(ValueError, match="layer 7 "):
        stream.update(hidden)
    with pytest.raises(ValueError, match="hidden must be"):
        stream.update(torch.randn(2, 10, 4))
    with pytest.raises(ValueError, match="keep must be"):
        stream.update(torch.randn(3, 10, 4), torch.ones(9, dtype=torch.bool))
    stream = LS.StreamingLayerStats(3, 4)
    stream.update(torch.randn(3, 3, 4))
    with pytest.raises(ValueError, match="only 3 tokens"):
        stream.finalize()
    stream.update(torch.randn(3, 5, 4))
    stream.finalize()
    with pytest.raises(RuntimeError, match="finalize"):
        stream.update(torch.randn(3, 5, 4))


def test_accumulator_bytes_matches_the_allocated_tensors():
    stream = LS.StreamingLayerStats(5, 7, chunk_tokens=3)
    stream.update(torch.randn(5, 4, 7))
    allocated = sum(t.numel() * t.element_size() for t in
                    [stream._sums, stream._sq_sums, stream._sq_products, stream._sq_weighted,
                     *stream._cross.values()])
    chunk = 3 * 5 * 7 * 8  # one float64 working chunk of chunk_tokens tokens
    assert LS.StreamingLayerStats.accumulator_bytes(5, 7, chunk_tokens=3) == allocated + chunk


@pytest.mark.parametrize("debiased", [False, True])
def test_cka_of_constant_features_is_an_error_not_nan(debiased):
    varying = torch.randn(16, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    constant = torch.ones(16, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="Y is constant over the tokens"):
        M.linear_cka(varying, constant, debiased=debiased)
    with pytest.raises(ValueError, match="X is constant over the tokens"):
        M.minibatch_cka([(constant[:8], varying[:8]), (constant[8:], varying[8:])])
