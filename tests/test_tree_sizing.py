"""Hardware-aware tree sizing: acceptance by rank, expected accepted length, the chosen shape
on hand-made cost curves, and the measured, cached cost curve of a tiny target."""
import pytest
import torch

from actwave.decoding import costmodel
from actwave.decoding.tree import choose_shape, node_values, rank_acceptance
from actwave.eagle3 import Eagle3Draft


def test_rank_acceptance_from_chain_and_top_k_reach():
    # chain: reach 0.5, 0.25 -> conditional 0.5, 0.5; top-3: reach 0.8, 0.48 -> 0.8, 0.6
    p = rank_acceptance({1: [0.5, 0.25], 3: [0.8, 0.48]})
    assert p.shape == (2, 3)
    torch.testing.assert_close(p[:, 0], torch.tensor([0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(p[:, 1:], torch.tensor([[0.15, 0.15], [0.05, 0.05]],
                                                     dtype=torch.float64))


def test_rank_acceptance_refuses_bad_values():
    with pytest.raises(ValueError, match=r"acceptance\[1\] must be .*probabilities in \[0, 1\]"):
        rank_acceptance([0.5, 1.5])
    with pytest.raises(ValueError, match="top_k >= 1"):
        rank_acceptance({0: [0.5]})


def test_node_values_of_a_chain_and_a_tree():
    p = rank_acceptance({1: [0.5, 0.25], 2: [0.75, 0.5625]})  # rank 2 adds 0.25 at each depth
    assert node_values(p, depth=2, top_k=1) == pytest.approx([0.5, 0.25])
    # level 1: 0.5, 0.25; level 2 children of both: 0.25, 0.125, 0.0625, 0.125·0.5=0.0625
    values = node_values(p, depth=2, top_k=2)
    assert values == pytest.approx(sorted([0.5, 0.25, 0.25, 0.125, 0.125, 0.0625], reverse=True))


def test_choose_shape_follows_the_cost_curve():
    p = rank_acceptance({1: [0.9] * 6, 4: [0.99] * 6})
    flat = [1.0] * 64  # verification costs the same for any size: the biggest tree wins
    shape = choose_shape(p, flat, [0.0] * 4, 0.0, 1.0, max_depth=6, max_top_k=4)
    assert shape.depth == 6 and shape.top_k == 4 and shape.mode == "tree"
    steep = [float(n) for n in range(1, 65)]  # a token costs a greedy step: drafting never pays
    shape = choose_shape(p, steep, [0.0] * 4, 0.0, 1.0, max_depth=6, max_top_k=4)
    assert shape.total_tokens == 2 and shape.predicted_speedup == pytest.approx(1.9 / 2)


def test_chain_data_only_gives_a_chain_and_its_prediction():
    shape = choose_shape(rank_acceptance([0.8, 0.64, 0.512]), [1.0] * 8, [0.1] * 4, 0.1, 1.0)
    assert (shape.mode, shape.depth, shape.top_k, shape.total_tokens) == ("chain", 3, 1, 4)
    assert shape.expected_tokens == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert shape.round_seconds == pytest.approx(0.1 + 2 * 0.1 + 1.0)
    assert shape.predicted_speedup == pytest.approx(shape.expected_tokens / shape.round_seconds)


def test_costs_are_measured_once_and_cached(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTWAVE_CACHE", str(tmp_path))
    draft = Eagle3Draft.from_target(llama, (1, 4), draft_vocab_size=64).eval()
    curve = costmodel.load_or_measure(llama, draft, context=12, max_tokens=5, max_width=2, repeats=1)
    assert len(curve.verify_seconds) == 5 and len(curve.level_seconds) == 2
    assert min(curve.verify_seconds + curve.level_seconds) > 0 and curve.greedy_seconds > 0
    monkeypatch.setattr(costmodel, "measure_costs", lambda *a, **k: pytest.fail("re-measured"))
    again = costmodel.load_or_measure(llama, draft, context=12, max_tokens=5, max_width=2, repeats=1)
    assert again == curve
    assert len(list(tmp_path.glob("costmodel/*/curve.json"))) == 1


def test_held_out_acceptance_of_a_random_draft(llama):
    """Reach probabilities lie in [0, 1], fall with depth and grow with top-k."""
    from test_speculative import prompt, random_draft
    ids = prompt(seed=4)
    texts = costmodel.greedy_texts(llama, [ids], max_new_tokens=12)
    assert len(texts[0][0]) == ids.shape[1] + 12 and texts[0][1] == ids.shape[1]
    reach = costmodel.held_out_acceptance(llama, random_draft(llama), texts, depth=3, top_ks=(1, 4))
    for k in (1, 4):
        assert len(reach[k]) == 3 and all(0 <= x <= 1 for x in reach[k])
        assert reach[k] == sorted(reach[k], reverse=True)
    assert all(a <= b for a, b in zip(reach[1], reach[4]))
