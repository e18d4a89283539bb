"""actwave.stats.sensitivity and the metrics/analysis pieces it adds (row normalisation, top
eigenvalue share, all-pairs Gram-route CKA, resolution of the compartments), on tiny
synthetic data and a tiny capture store in the real shard format."""
from __future__ import annotations

import itertools

import pytest
import torch
from test_analysis import write_store
from test_metrics import block_cka

from actwave.capture.store import CaptureStore
from actwave.config import config_hash
from actwave.stats import layerstats as LS
from actwave.stats import metrics as M
from actwave.stats import sensitivity as S
from actwave.stats.analysis import AnalysisConfig, _cache_key, compute_layer_stats, token_keep_mask
from actwave.stats.analysis import token_settings


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path / "cache"))
    columns = write_store(tmp_path / "store")
    return CaptureStore(tmp_path / "store"), columns


def massive_token_states(n: int = 200, d: int = 16, seed: int = 0) -> torch.Tensor:
    """``(n, d)`` isotropic Gaussian states with one token carrying a huge channel."""
    Z = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    Z[0, 3] = 1000.0
    return Z


# ----------------------------------------------------------------------------- row norm
def test_row_normalisation_changes_nothing_at_unit_norm():
    hidden = M.unit_rows(torch.randn(3, 80, 12, generator=torch.Generator().manual_seed(1)))
    raw, normalised = LS.layer_stats(hidden), LS.layer_stats(M.unit_rows(hidden))
    for name in ("entropy", "renyi2", "cka"):
        torch.testing.assert_close(getattr(normalised, name), getattr(raw, name),
                                   rtol=1e-5, atol=1e-6)


def test_row_normalisation_removes_a_massive_token():
    Z = massive_token_states()
    raw_cov, unit_cov = (M._centre(x).T @ M._centre(x) for x in (Z, M.unit_rows(Z)))
    assert M.top_eigen_share(raw_cov) > 0.95  # one token, one channel: all the variance
    assert M.top_eigen_share(unit_cov) < 0.25  # near isotropic again (1/d = 0.0625)
    assert M.matrix_entropy(M.unit_rows(Z)) > M.matrix_entropy(Z) + 1.5


def test_row_normalize_is_applied_in_the_streaming_pass(store):
    capture, columns = store
    config = AnalysisConfig(filter="quantile", filter_value=0.5, row_normalize=True)
    stats = compute_layer_stats(capture, config, progress=False)
    keep, _ = token_keep_mask(capture, config)
    expected = LS.layer_stats(M.unit_rows(columns["hidden"])[:, keep].double())
    torch.testing.assert_close(stats.entropy, expected.entropy, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(stats.cka, expected.cka, rtol=1e-6, atol=1e-8)
    raw = compute_layer_stats(capture, AnalysisConfig(filter="quantile", filter_value=0.5),
                              progress=False)
    assert (raw.entropy - stats.entropy).abs().max() > 1e-3  # the variant is not a no-op


def test_default_cache_key_unchanged_and_row_normalize_keyed():
    class FakeStore:
        digest = "abc123"  # the store's content digest keys its statistics
    # row_normalize at its default stays out of the key (keys are pinned: a change of key
    # layout must be deliberate)
    assert "row_normalize" not in _cache_key(FakeStore, AnalysisConfig())["analysis"]
    assert config_hash(_cache_key(FakeStore, AnalysisConfig())) == "807d4f359359"
    assert config_hash(_cache_key(FakeStore, AnalysisConfig(
        filter="quantile", filter_value=0.5, matmul_dtype="float32"))) == "b5e880abd0f4"
    keyed = _cache_key(FakeStore, AnalysisConfig(row_normalize=True))
    assert keyed["analysis"]["row_normalize"] is True
    assert config_hash(keyed) != "807d4f359359"
    with pytest.raises(ValueError, match="row_normalize must be True or False, got 'yes'"):
        AnalysisConfig(row_normalize="yes")


# ----------------------------------------------------------------------------- spectra
def test_top_eigen_share_equals_svd_route():
    Z = torch.randn(60, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    Z[:, 0] *= 4.0
    Zc = Z - Z.mean(0)
    singular = torch.linalg.svdvals(Zc)
    assert M.top_eigen_share(Zc.T @ Zc) == pytest.approx(
        float(singular[0] ** 2 / singular.square().sum()), rel=1e-10)
    assert M.top_eigen_share(torch.eye(8)) == pytest.approx(1 / 8)
    with pytest.raises(ValueError, match="square"):
        M.top_eigen_share(torch.ones(3, 4))


def test_top_eigen_shares_per_layer_from_stats():
    hidden = torch.stack([torch.randn(50, 6, dtype=torch.float64,
                                      generator=torch.Generator().manual_seed(s))
                          for s in range(3)])
    hidden[2, :, 1] *= 30.0  # one dominant channel in the last layer
    shares = S.top_eigen_shares(LS.layer_stats(hidden))
    assert shares.shape == (3,)
    for layer in range(3):
        Zc = hidden[layer] - hidden[layer].mean(0)
        assert float(shares[layer]) == pytest.approx(M.top_eigen_share(Zc.T @ Zc), rel=1e-9)
    assert shares[2] > 0.9 > shares[0]


@pytest.mark.parametrize("debiased", [True, False])
def test_gram_route_cka_matrix_equals_pairwise_cka(debiased):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 40, 7, generator=g, dtype=torch.float64)
    hidden[1] = hidden[0] @ torch.randn(7, 7, generator=g, dtype=torch.float64) + 0.2 * hidden[1]
    matrix = M.linear_cka_matrix(hidden, debiased=debiased, block_rows=6)
    for a, b in itertools.product(range(4), repeat=2):
        assert float(matrix[a, b]) == pytest.approx(
            float(M.linear_cka(hidden[a], hidden[b], debiased=debiased)), abs=1e-12)
    with pytest.raises(ValueError, match="constant"):
        M.linear_cka_matrix(torch.ones(2, 10, 3, dtype=torch.float64))


# ----------------------------------------------------------------------------- compartments
def brute_force_compartments(cka: torch.Tensor, gamma: float) -> list[tuple[int, int]]:
    """Q_γ = Σ_blocks Σ_{i,j∈block}[W_ij − γ k_i k_j / 2m] over every contiguous segmentation."""
    W = cka.clamp(min=0)
    W = (W + W.T) / 2
    W.fill_diagonal_(0)
    k, two_m, L = W.sum(1), W.sum(), len(W)
    best = None
    for cuts in itertools.product([False, True], repeat=L - 1):
        starts = [0] + [i + 1 for i, cut in enumerate(cuts) if cut]
        blocks = list(zip(starts, [s - 1 for s in starts[1:]] + [L - 1]))
        q = sum(float(W[a:b + 1, a:b + 1].sum() - gamma * k[a:b + 1].sum() ** 2 / two_m)
                for a, b in blocks)
        if best is None or q > best[0] + 1e-12:
            best = (q, blocks)
    return best[1]


@pytest.mark.parametrize("gamma", [0.5, 1.0, 1.5, 3.0])
def test_compartment_resolution_equals_generalised_modularity(gamma):
    cka = block_cka([2, 3, 3], within=0.8, between=0.45, noise=0.2, seed=4)
    assert M.compartments(cka, resolution=gamma) == brute_force_compartments(cka, gamma)


def test_resolution_one_is_todays_compartments_and_larger_splits_more():
    cka = block_cka([3, 5, 4], seed=5)
    assert M.compartments(cka, resolution=1.0) == M.compartments(cka) == [(0, 2), (3, 7), (8, 11)]
    found = S.segmentations(cka, [0.2, 1.0, 5.0], layers=range(10, 22))
    assert found[1.0] == ((10, 12), (13, 17), (18, 21))  # rows mapped to layer ids
    assert len(found[0.2]) <= 3 <= len(found[5.0])


def test_coverage_and_boundaries():
    blocks = ((0, 1), (2, 14), (15, 30))
    assert S.coverage(blocks, (2, 15, 27)) == {"hits_all": False, "one_per_block": False,
                                              "n_blocks": 3}
    assert S.coverage(blocks, (1, 2, 15)) == {"hits_all": True, "one_per_block": True,
                                             "n_blocks": 3}
    assert S.boundaries(blocks) == (2, 15) and S.format_blocks(blocks) == "0-1|2-14|15-30"


# ----------------------------------------------------------------------------- bootstrap
def test_resample_tokens_draws_whole_sequences_then_caps():
    groups = [torch.arange(0, 5), torch.arange(5, 12), torch.arange(12, 15)]
    ids = S.resample_tokens(groups, 1000, torch.Generator().manual_seed(0))
    counts = torch.bincount(ids, minlength=15)
    for group in groups:  # a sequence enters with all its tokens, as often as it was drawn
        assert len(set(counts[group].tolist())) == 1
    assert ids.numel() == sum(int(counts[g[0]]) * len(g) for g in groups)
    assert torch.equal(ids, ids.sort().values)
    capped = S.resample_tokens(groups, 4, torch.Generator().manual_seed(0))
    assert capped.numel() == 4


def test_gather_states_reads_the_ids_with_repeats(store):
    capture, columns = store
    ids = torch.tensor([0, 3, 3, 49, 50, 119, 120, 159])  # across all three shards
    gathered = S.gather_states(capture, ids)
    assert gathered.dtype == torch.float32 and gathered.shape == (4, 8, 8)
    torch.testing.assert_close(gathered, columns["hidden"][:, ids].float())


def test_bootstrap_shares_sum_to_one_and_repeat(store):
    capture, _ = store
    keep, _ = token_keep_mask(capture, AnalysisConfig())
    config = S.BootstrapConfig(n_boot=4, boot_tokens=60, resolutions=(0.5, 1.0, 2.0), seed=1)
    records = S.bootstrap_compartments(capture, keep, config, progress=False)
    assert len(records) == 4 * 3 and {r["n_tokens"] for r in records} == {60}
    assert records == S.bootstrap_compartments(capture, keep, config, progress=False)
    shares = S.segmentation_shares(records)
    for gamma in config.resolutions:
        assert sum(r["share"] for r in shares if r["resolution"] == gamma) == pytest.approx(1.0)
    assert all(0 < r["share"] <= 1 for r in S.boundary_shares(records))
    coverage = S.default_coverage(records, (1, 2, 3))
    assert [r["n_replicates"] for r in coverage] == [4, 4, 4]
    assert all(0 <= r["hits_all_share"] <= 1 for r in coverage)


def test_bootstrap_config_and_parse_errors():
    with pytest.raises(ValueError, match="n_boot=0"):
        S.BootstrapConfig(n_boot=0)
    with pytest.raises(ValueError, match="γ > 0"):
        S.BootstrapConfig(resolutions=(0.0, 1.0))
    assert S.parse_values("0, 0.25,0.5", "q", 0, 1) == (0.0, 0.25, 0.5)
    with pytest.raises(ValueError, match=r"q: 1.5 outside the allowed range \[0, 1\)"):
        S.parse_values("0,1.5", "q", 0, 1)
    with pytest.raises(ValueError, match="'x' is not a number"):
        S.parse_values("0,x", "q", 0, 1)


def test_selected_sets_add_the_default_and_refuse_unknown_methods():
    stats = LS.layer_stats(torch.randn(8, 40, 5, generator=torch.Generator().manual_seed(6)))
    config = S.selection_report.SelectionConfig()
    rows = S.selected_sets(stats, config, ["entropy_topk"])
    assert [r["label"] for r in rows] == ["entropy_topk", "eagle3_default"]
    assert rows[1]["layers"] == (2, 3, 4)  # (2, N//2, N-3) with N = 7
    assert 0 <= rows[1]["renyi2_pct"] <= 100
    with pytest.raises(ValueError, match=r"unknown selection methods \['best'\]"):
        S.selected_sets(stats, config, ["best"])


def test_variants_share_the_analysis_notebooks_cache_keys():
    variants = S.variant_configs([0, 0.5], [0], seed=0, matmul_dtype="float32")
    assert list(variants) == ["all tokens", "q≥0.5", "all tokens · unit rows"]
    notebooks = token_settings(0.5, matmul_dtype="float32")
    assert variants["all tokens"] == notebooks["all tokens"]
    assert variants["q≥0.5"] == notebooks["top 50% entropy"]
    assert variants["all tokens · unit rows"].row_normalize
    with pytest.raises(ValueError, match=r"quantiles \(0.5,\) must include 0"):
        S.variant_configs([0.5], [])
