"""Layer selection: baselines, exhaustive/greedy search, methods, invariances, errors."""
import itertools
import math

import numpy as np
import pytest
import torch

from actwave.stats import selection, selection_report
from actwave.stats import layerstats
from actwave.stats.layerstats import LayerStats, layer_stats


def make_stats(entropy, cka, renyi2=None) -> LayerStats:
    """LayerStats over layers 0..L-1 from given per-layer entropies and a CKA matrix."""
    entropy = torch.as_tensor(entropy, dtype=torch.float64)
    cka = torch.as_tensor(cka, dtype=torch.float64)
    renyi2 = entropy * 0.8 if renyi2 is None else torch.as_tensor(renyi2, dtype=torch.float64)
    return LayerStats(layers=tuple(range(len(entropy))), n_tokens=1000, dim=16,
                      entropy=entropy, renyi2=renyi2, cka=cka, cka_biased=cka.clone())


def random_stats(num_layers: int, seed: int) -> LayerStats:
    """Layers 0..N with random entropies and a random PSD, unit-diagonal CKA-like matrix."""
    gen = torch.Generator().manual_seed(seed)
    size = num_layers + 1
    features = torch.rand(size, 6, generator=gen, dtype=torch.float64)
    gram = features @ features.T
    scale = gram.diagonal().rsqrt()
    cka = gram * scale[:, None] * scale[None, :]
    entropy = 2.0 + 3.0 * torch.rand(size, generator=gen, dtype=torch.float64)
    renyi2 = entropy - torch.rand(size, generator=gen, dtype=torch.float64)
    return make_stats(entropy, cka, renyi2)


def permuted(stats: LayerStats, perm: list[int]) -> LayerStats:
    """New layer i carries old layer perm[i]'s statistics."""
    index = torch.tensor(perm)
    return make_stats(stats.entropy[index], stats.cka[index][:, index], stats.renyi2[index])


# ----------------------------------------------------------------------------- baselines
def test_eagle3_default_matches_published_rule():
    assert selection.eagle3_default(32) == (2, 16, 29)  # Llama-3.1-8B, SafeAILab
    assert selection.eagle3_default(30) == (2, 15, 27)  # SmolLM2-135M
    assert selection.eagle3_default(18) == (2, 9, 15)  # Gemma-3-270M
    assert selection.eagle3_default(7) == (2, 3, 4)
    for bad in (6, 4, 0, 7.0, True):
        with pytest.raises(ValueError, match="N must be"):
            selection.eagle3_default(bad)


def test_fixed_baselines():
    assert selection.evenly_spaced(30, 3) == (5, 15, 25)
    assert selection.evenly_spaced(5, 5) == (1, 2, 3, 4, 5)
    assert selection.evenly_spaced(18, 1) == (9,)
    assert selection.last_k(30, 3) == (28, 29, 30)
    assert selection.first_k(30, 3) == (1, 2, 3)
    with pytest.raises(ValueError, match="k must be"):
        selection.last_k(2, 3)


def test_random_layers_seeded_distinct_and_in_range():
    draws = {selection.random_layers(30, 3, seed) for seed in range(20)}
    assert selection.random_layers(30, 3, 7) == selection.random_layers(30, 3, 7)
    assert len(draws) > 10  # seeds matter
    for draw in draws:
        assert len(set(draw)) == 3 and list(draw) == sorted(draw) and min(draw) >= 1
        assert max(draw) <= 30
    assert selection.random_layers(30, 2, 0, candidates=[4, 9]) == (4, 9)


# ----------------------------------------------------------------------------- search
def test_all_subsets_enumerates_combinations():
    subsets = selection.all_subsets(6, 3)
    expected = list(itertools.combinations(range(1, 7), 3))
    assert [tuple(r) for r in subsets.tolist()] == expected
    assert selection.all_subsets([9, 2, 5], 2).tolist() == [[2, 5], [2, 9], [5, 9]]
    assert selection.all_subsets(40, 4).shape == (math.comb(40, 4), 4)


def test_exhaustive_finds_true_maximum_and_batches_consistently():
    weights = torch.tensor([0.0, 3.0, -1.0, 5.0, 2.0, 4.0, 0.5])

    def pairwise(subsets):  # non-modular: rewards spread in depth
        values = weights[subsets].sum(1)
        return values + 0.7 * (subsets[:, -1] - subsets[:, 0]).double().float()

    best, subsets, scores = selection.exhaustive(pairwise, range(1, 7), 3)
    _, _, scores_small_batches = selection.exhaustive(pairwise, range(1, 7), 3, batch=4)
    brute = max(itertools.combinations(range(1, 7), 3),
                key=lambda s: float(pairwise(torch.tensor([s]))[0]))
    assert best == brute
    assert torch.equal(scores, scores_small_batches)
    assert selection.percentile(selection.score_of(best, subsets, scores), scores) == 100.0


def test_percentile_and_lookup():
    scores = torch.arange(10.0)
    assert selection.percentile(scores.min(), scores) == 10.0
    assert selection.percentile(4.5, scores) == 50.0
    subsets = selection.all_subsets(5, 2)
    assert selection.score_of((4, 2), subsets, torch.arange(10.0)) == 5.0  # row (2, 4)
    with pytest.raises(ValueError, match="not among"):
        selection.score_of((1, 9), subsets, torch.arange(10.0))
    with pytest.raises(ValueError, match="empty"):
        selection.percentile(1.0, torch.tensor([]))


# ----------------------------------------------------------------------------- objectives
def test_objectives_match_direct_formulas():
    stats = random_stats(8, seed=1)
    subsets = selection.all_subsets(8, 3)
    entropy, cka = stats.entropy.numpy(), stats.cka.numpy()
    theta = 0.7
    logdet = selection.objective("logdet", stats, theta=theta)(subsets)
    dispersion = selection.objective("dispersion", stats)(subsets)
    total = selection.objective("entropy_sum", stats)(subsets)
    for row, subset in enumerate(subsets.tolist()):
        block = cka[np.ix_(subset, subset)]
        quality = np.exp(theta * entropy[subset])
        kernel = quality[:, None] * block * quality[None, :]
        assert logdet[row].item() == pytest.approx(np.log(np.linalg.det(kernel)), rel=1e-9)
        pairs = [1 - cka[a, b] for a, b in itertools.combinations(subset, 2)]
        assert dispersion[row].item() == pytest.approx(min(pairs), rel=1e-12)
        assert total[row].item() == pytest.approx(entropy[subset].sum(), rel=1e-12)


def test_logdet_of_non_psd_block_is_minus_inf():
    cka = torch.eye(4, dtype=torch.float64)
    cka[1, 2] = cka[2, 1] = 1.5  # det of [[1, 1.5], [1.5, 1]] < 0
    stats = make_stats([1.0, 1.0, 1.0, 1.0], cka)
    scores = selection.logdet_score(stats)(torch.tensor([[1, 2], [1, 3]]))
    assert scores[0] == -math.inf and torch.isfinite(scores[1])
    with pytest.raises(ValueError, match="unknown objective"):
        selection.objective("nope", stats)


# ----------------------------------------------------------------------------- greedy == exhaustive
def test_entropy_topk_and_greedy_equal_exhaustive_for_modular_objective():
    for seed in range(5):
        stats = random_stats(12, seed)
        best = selection.exhaustive(selection.entropy_sum_score(stats), range(1, 13), 3)[0]
        assert selection.select("entropy_topk", stats) == best
        assert selection.greedy(selection.entropy_sum_score(stats), range(1, 13), 3) == best


def test_mrmr_and_logdet_greedy_exact_without_redundancy():
    """Zero cross-layer CKA: mRMR reduces to top-k entropy, log det to 2θΣH (modular)."""
    gen = torch.Generator().manual_seed(3)
    entropy = 1.0 + torch.rand(11, generator=gen, dtype=torch.float64)
    stats = make_stats(entropy, torch.eye(11, dtype=torch.float64))
    top = selection.exhaustive(selection.entropy_sum_score(stats), range(1, 11), 4)[0]
    assert selection.select("mrmr", stats, k=4, lam=5.0) == top
    assert selection.select("logdet_dpp", stats, k=4, search="greedy") == top
    assert selection.select("logdet_dpp", stats, k=4) == top


def test_mrmr_avoids_redundant_layers():
    """Layers 1-3 are copies (CKA 1) with the highest entropy; mRMR takes only one of them."""
    cka = torch.eye(7, dtype=torch.float64)
    cka[1:4, 1:4] = 1.0
    stats = make_stats([0.0, 5.0, 4.9, 4.8, 3.0, 2.0, 1.0], cka)
    assert selection.select("entropy_topk", stats) == (1, 2, 3)
    assert selection.select("mrmr", stats, lam=2.0) == (1, 4, 5)
    # λ=1: a copy (0.98 − mean(1, 0)) still beats layer 5 (0.4): mean redundancy dilutes
    assert selection.select("mrmr", stats, lam=1.0) == (1, 2, 4)
    assert selection.select("mrmr", stats, lam=0.0) == (1, 2, 3)
    assert selection.select("logdet_dpp", stats) == (1, 4, 5)


def test_cka_methods_pick_one_layer_per_block():
    """Three blocks of near-identical layers: CKA-diversity methods span all blocks."""
    blocks = [(1, 4), (5, 8), (9, 12)]
    cka = torch.full((13, 13), 0.1, dtype=torch.float64)
    for first, last in blocks:
        cka[first:last + 1, first:last + 1] = 0.95
    cka.fill_diagonal_(1.0)
    entropy = torch.linspace(3.0, 4.0, 13, dtype=torch.float64).flip(0)
    stats = make_stats(entropy, cka)
    for method in ("cka_farthest", "logdet_dpp", "mrmr"):
        chosen = selection.select(method, stats)
        assert sorted(next(i for i, (a, b) in enumerate(blocks) if a <= c <= b)
                      for c in chosen) == [0, 1, 2], method
    # highest entropy (shallowest) layer of each compartment
    assert selection.select("cka_compartments", stats, compartments=blocks) == (1, 5, 9)
    # two compartments for k=3: the third is the best remaining layer
    assert selection.select("cka_compartments", stats, compartments=[(1, 8), (9, 12)]) \
        == (1, 2, 9)


# ----------------------------------------------------------------------------- invariance
RELABEL_INVARIANT = [("entropy_topk", {}), ("mrmr", {"lam": 0.8}), ("logdet_dpp", {}),
                     ("logdet_dpp", {"search": "greedy"}), ("cka_farthest", {}),
                     ("renyi2_exhaustive", {}), ("greedy_aggregate_entropy", {"alpha": 2.0})]


@pytest.mark.parametrize("method,options", RELABEL_INVARIANT)
def test_selection_follows_layer_relabelling(method, options):
    stats = random_stats(10, seed=11)
    gen = torch.Generator().manual_seed(5)
    perm = [0] + (torch.randperm(10, generator=gen) + 1).tolist()  # keep ℓ=0 in place
    chosen = selection.select(method, stats, **options)
    chosen_permuted = selection.select(method, permuted(stats, perm), **options)
    assert tuple(sorted(perm.index(old) for old in chosen)) == chosen_permuted


# ----------------------------------------------------------------------------- select()
def test_select_dispatch_candidates_and_determinism():
    stats = random_stats(30, seed=2)
    assert selection.select("eagle3_default", stats) == (2, 15, 27)
    assert selection.select("random", stats, seed=4) == selection.select("random", stats, seed=4)
    chosen = selection.select("entropy_topk", stats, k=2, candidates=[7, 3, 12])
    assert set(chosen) <= {3, 7, 12} and list(chosen) == sorted(chosen)
    with_zero = make_stats(torch.tensor([9.0, 1.0, 2.0, 3.0]), torch.eye(4))
    assert 0 not in selection.select("entropy_topk", with_zero, k=2)
    assert 0 in selection.select("entropy_topk", with_zero, k=2, candidates=[0, 1, 2, 3])


def test_select_errors_are_clear():
    stats = random_stats(8, seed=0)
    with pytest.raises(ValueError, match=r"unknown selection method 'best'.*entropy_topk"):
        selection.select("best", stats)
    for bad_k in (0, 9, -1, 2.0):
        with pytest.raises(ValueError, match=r"k must be an int in \[1, 8\]"):
            selection.select("entropy_topk", stats, k=bad_k)
    with pytest.raises(ValueError, match="unknown: \\[42\\]"):
        selection.select("mrmr", stats, candidates=[1, 42])
    with pytest.raises(ValueError, match="exactly 3"):
        selection.select("eagle3_default", random_stats(30, 0), k=2)
    with pytest.raises(ValueError, match="search must be"):
        selection.select("logdet_dpp", stats, search="beam")


# ----------------------------------------------------------------------------- Rényi-2 aggregate
def hidden_state_stats(num_layers: int = 7, n_tokens: int = 400, dim: int = 12, seed: int = 0):
    """Real LayerStats of synthetic hidden states: a drifting residual stream."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(n_tokens, dim, generator=gen, dtype=torch.float64)
    layers = [state]
    for _ in range(num_layers):
        mix = torch.eye(dim, dtype=torch.float64) + 0.6 * torch.randn(dim, dim, generator=gen,
                                                                      dtype=torch.float64)
        state = state @ mix + 0.5 * torch.randn(n_tokens, dim, generator=gen, dtype=torch.float64)
        layers.append(state)
    return layer_stats(torch.stack(layers))  # hidden: (N+1, n, d)


def test_renyi2_exhaustive_is_the_true_best_concatenation():
    """Independent route: H₂ of the explicitly concatenated normalised covariance."""
    stats = hidden_state_stats()
    chosen = selection.select("renyi2_exhaustive", stats)
    brute = max(itertools.combinations(range(1, 8), 3),
                key=lambda s: layerstats.aggregate_entropy(stats, s, alpha=2.0))
    assert chosen == brute
    # greedy Shannon aggregate: its pick is at least as good as every set greedy passes by
    greedy_pick = selection.select("greedy_aggregate_entropy", stats, alpha=1.0)
    assert len(greedy_pick) == 3
    first = int(torch.argmax(stats.entropy[1:])) + 1
    assert first in greedy_pick


def test_greedy_aggregate_renyi2_exact_without_cross_similarity():
    """Zero cross-layer CKA: exp(−H₂(S)) = k⁻² Σ P_a is modular, so greedy is exact."""
    gen = torch.Generator().manual_seed(9)
    renyi2 = 1.0 + 2.0 * torch.rand(12, generator=gen, dtype=torch.float64)
    stats = make_stats(renyi2 + 0.5, torch.eye(12, dtype=torch.float64), renyi2)
    best = selection.exhaustive(selection.renyi2_score(stats), range(1, 12), 3)[0]
    assert selection.select("greedy_aggregate_entropy", stats, alpha=2.0) == best
    assert selection.select("renyi2_exhaustive", stats) == best


def test_compartment_layers_map_rows_to_layer_ids():
    cka = torch.full((6, 6), 0.05, dtype=torch.float64)
    cka[:3, :3] = 0.9
    cka[3:, 3:] = 0.9
    cka.fill_diagonal_(1.0)
    stats = make_stats(torch.arange(6.0), cka)
    stats.layers = (4, 5, 6, 7, 8, 9)
    assert selection.compartment_layers(stats) == [(4, 6), (7, 9)]
    assert selection.select("cka_compartments", stats, k=2) == (6, 9)


# ----------------------------------------------------------------------------- reports
def test_pairwise_scores_matrix():
    stats = random_stats(6, seed=4)
    matrix = selection_report.pairwise_scores(selection.renyi2_score(stats), [2, 4, 5])
    assert torch.isnan(matrix.diagonal()).all()
    assert torch.allclose(matrix, matrix.T, rtol=0, atol=0, equal_nan=True)
    direct = layerstats.aggregate_renyi2(stats, torch.tensor([[2, 5]]))[0]
    assert matrix[0, 2].item() == pytest.approx(direct.item(), rel=1e-12)


def test_compare_methods_scores_and_percentiles():
    stats = random_stats(12, seed=6)
    methods = {"default": ("eagle3_default", {}), "h2": ("renyi2_exhaustive", {}),
               "dpp": ("logdet_dpp", {"theta": 1.0}), "top": ("entropy_topk", {})}
    records = {r["label"]: r for r in selection_report.compare_methods(stats, methods)}
    assert records["h2"]["renyi2_pct"] == 100.0
    assert records["dpp"]["logdet_pct"] == 100.0
    assert records["top"]["entropy_sum_pct"] == 100.0
    assert records["default"]["layers"] == (2, 6, 9)
    direct = layerstats.aggregate_renyi2(stats, torch.tensor([[2, 6, 9]]))[0].item()
    assert records["default"]["renyi2"] == pytest.approx(direct, rel=1e-12)
    assert 0.0 < records["default"]["renyi2_pct"] <= 100.0


def test_set_profile_explains_a_set():
    cka = torch.full((7, 7), 0.1, dtype=torch.float64)
    cka[1:4, 1:4] = 0.9
    cka[4:, 4:] = 0.9
    cka[0, 0] = 1.0
    cka.fill_diagonal_(1.0)
    stats = make_stats([0.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0], cka)
    profile = selection_report.set_profile(stats, [3, 1, 2])
    assert profile["layers"] == (1, 2, 3) and profile["entropy_ranks"] == (1, 2, 3)
    assert profile["mean_cka"] == pytest.approx(0.9)
    assert profile["compartments_hit"] == 1 < profile["n_compartments"]
    assert selection_report.set_profile(stats, [1, 6])["compartments_hit"] == 2


def test_off_diagonal_mean():
    matrix = torch.tensor([[1.0, 0.2, 0.4], [0.2, 1.0, 0.6], [0.4, 0.6, 1.0]])
    assert selection_report.off_diagonal_mean(matrix).item() == pytest.approx(0.4)
    with pytest.raises(ValueError, match="square"):
        selection_report.off_diagonal_mean(torch.ones(2, 3))


def test_top_subsets_with_included_sets():
    subsets = selection.all_subsets(5, 2)  # 10 pairs, lexicographic
    scores = torch.tensor([0.0, 9.0, 1.0, 2.0, 9.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    top = selection_report.top_subsets(subsets, scores, 3, include=[(2, 1), (5, 1)])
    # best: (1,3) and (2,3) tie at 9 (enumeration order), then (4,5); (1,2) appended, (1,5) too
    assert top.tolist() == [[1, 3], [2, 3], [4, 5], [1, 2], [1, 5]]
    assert selection_report.top_subsets(subsets, scores, 2,
                                        include=[(3, 1)]).tolist() == [[1, 3], [2, 3]]


def test_selection_config_lists_every_method_with_options():
    # greedy_alpha=2 takes the closed form: random_stats carry no covariance blocks
    config = selection_report.SelectionConfig(mrmr_lambda=0.3, seed=5, greedy_alpha=2.0)
    methods = config.methods()
    assert set(methods) == set(selection.METHODS)
    assert methods["mrmr"] == ("mrmr", {"lam": 0.3})
    assert methods["random"] == ("random", {"seed": 5})
    records = selection_report.compare_methods(random_stats(9, seed=1), methods)
    assert [r["label"] for r in records] == list(methods)
    with pytest.raises(ValueError, match="combined_method 'best' unknown"):
        selection_report.SelectionConfig(combined_method="best")
    with pytest.raises(ValueError, match="k must be"):
        selection_report.SelectionConfig(k=0)


def test_size_guards_name_the_cost_and_the_faster_method():
    # 30 choose 6 used to build a 30^6 grid (5.8 GB); now C(30, 6) rows only
    assert selection.all_subsets(30, 6).shape == (math.comb(30, 6), 6)
    assert selection.all_subsets(30, 30).tolist() == [list(range(1, 31))]
    with pytest.raises(ValueError, match=r"C\(30, 12\) = 86,493,225 subsets .*greedy methods"):
        selection.all_subsets(30, 12)
    cost = selection.greedy_entropy_cost(30, 30, 576)
    assert cost["eigendecompositions"] == 465 and cost["largest_matrix"] == 30 * 576
    stats = random_stats(30, seed=2)
    stats.dim = 576  # the guard reads d only: refused before any eigendecomposition
    with pytest.raises(ValueError, match=r"465 eigendecompositions .*use renyi2_exhaustive"):
        selection.select("greedy_aggregate_entropy", stats, k=30)


@pytest.mark.parametrize("bad", [[2.7, 3], [True, 3], ["2", 3], [2, None], 3])
def test_layer_ids_must_be_real_ints(bad):
    with pytest.raises(ValueError, match="int"):
        selection.select("renyi2_exhaustive", random_stats(9, seed=1), k=2, candidates=bad)
