"""Prompt-lookup rounds: the n-gram index against a brute-force search, the offline walk
by hand and against real decoding (same rounds, same lookup rounds, same acceptance), the
cost model's prediction by hand, and decoding with lookup rounds equal to plain greedy
(random and oracle drafts; Llama, Qwen3, Gemma3)."""
from collections import Counter

import pytest
import torch

from actwave.decoding.costmodel import CostCurve, auto_lookup, held_out_roots
from actwave.decoding.lookup import (MAX_NGRAM, MIN_NGRAM, NgramIndex, leading_matches,
                                     score_walk, walk_rounds)
from actwave.decoding.report import summarize
from actwave.decoding.speculative import generate, greedy_generate
from actwave.decoding.tree import TreeShape
from test_speculative import oracle_draft, random_draft


def brute_force_proposal(tokens: list[int], max_tokens: int) -> list[int]:
    """The longest suffix n-gram's most recent earlier occurrence, by scanning backwards."""
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        suffix = tokens[len(tokens) - n:] if len(tokens) >= n else None
        for start in range(len(tokens) - n - 1, -1, -1):
            if suffix is not None and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + max_tokens]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_index_proposes_what_a_backward_scan_finds(seed):
    tokens = torch.randint(0, 5, (300,), generator=torch.Generator().manual_seed(seed)).tolist()
    index = NgramIndex(tokens[:1])
    found = 0
    for end in range(2, len(tokens) + 1):
        index.extend([tokens[end - 1]])
        expected = brute_force_proposal(tokens[:end], 4)
        assert index.propose(4) == expected
        found += bool(expected)
    assert found > 200  # a 5-token alphabet repeats: the matches were exercised


def test_index_never_matches_the_suffix_itself():
    assert NgramIndex([1, 2, 3]).propose(4) == []
    assert NgramIndex([7, 8, 7, 8]).propose(3) == [7, 8]  # [7, 8] ended at position 1
    assert NgramIndex([5, 5]).propose(2) == []  # a 1-gram match is not enough (MIN_NGRAM = 2)


def test_walk_rounds_by_hand():
    ids = [3, 1, 2, 3, 1, 2, 3, 4, 9, 9]  # the reply starts at index 3: roots 3..8
    rounds = walk_rounds(ids, 3, draft_accepted=[0, 1, 0, 0, 0, 0], lookup=4)
    # root 3 (3 1 2 3): [2, 3] has no earlier end -> draft round, accepts draft_accepted[0] = 0;
    # root 4 (…3 1): [3, 1] ended at 1 -> copies what followed, as far as the text goes:
    # [2, 3, 1]; the reply goes on 2 3 4: 2 accepted; root 7 (…3 4) and root 8 (4 9): no
    # earlier n-gram -> draft rounds accepting draft_accepted[4] = [5] = 0; root 9 ends the text
    assert rounds == [(0, 0), (3, 2), (0, 0), (0, 0)]
    assert walk_rounds(ids, 3, [0, 1, 0, 0, 0, 0], lookup=0) == [(0, 0), (0, 1), (0, 0),
                                                                 (0, 0), (0, 0)]
    with pytest.raises(ValueError, match="roots"):
        walk_rounds(ids, 3, [0, 0], lookup=4)


def scored_shape(expected=1.5, seconds=1.2):
    return TreeShape("tree", depth=1, top_k=2, total_tokens=3, expected_tokens=expected,
                     round_seconds=seconds, predicted_speedup=expected / seconds)


def test_score_walk_by_hand():
    texts = [([3, 1, 2, 3, 1, 2, 3, 4, 9, 9], 3, [0, 1, 0, 0, 0, 0])]
    verify = [1.0, 1.1, 1.2, 1.5, 1.7, 2.0]
    shape = score_walk(scored_shape(), texts, 4, verify, greedy_seconds=1.0)
    # rounds as in test_walk_rounds_by_hand: three draft rounds (1.2 s each) and one lookup
    # round verifying 1 + 3 tokens (1.5 s); 6 tokens after the prefill's first
    assert shape.lookup == 4 and shape.label() == "tree 1/2/3 + lookup 4"
    assert shape.expected_tokens == pytest.approx(6 / 4)
    assert shape.round_seconds == pytest.approx((3 * 1.2 + 1.5) / 4)
    assert shape.predicted_speedup == pytest.approx(6 / (3 * 1.2 + 1.5))
    draft_only = score_walk(scored_shape(), texts, 0, verify, greedy_seconds=1.0)
    assert draft_only.lookup == 0 and draft_only.expected_tokens == pytest.approx(6 / 5)
    with pytest.raises(ValueError, match="scored"):
        score_walk(TreeShape(), texts, 2, verify, 1.0)
    with pytest.raises(ValueError, match="verify curve"):
        score_walk(scored_shape(), texts, 6, verify, 1.0)


@pytest.mark.parametrize("shape", [TreeShape("chain", depth=3, lookup=4),
                                   TreeShape("tree", depth=1, top_k=2, total_tokens=3, lookup=3)])
def test_walk_is_what_decoding_runs(target, shape):
    """On the target's greedy text, the walk over offline per-root acceptance runs the rounds
    decoding runs: the same number, the same lookup rounds, the same accepted counts (a chain
    and a one-level tree, where per-root top-k acceptance is exact)."""
    ids = looping_prompt(target)
    draft = random_draft(target)
    result = generate(target, draft, ids, 40, shape=shape)
    text = torch.cat([ids[0], torch.tensor(result.tokens)])
    accepted, = held_out_roots(target, draft, [(text, ids.shape[1])], shape.depth, shape.top_k)
    rounds = walk_rounds(text.tolist(), ids.shape[1], accepted.tolist(), shape.lookup)
    assert len(rounds) == result.target_forwards - 1
    assert sum(m > 0 for m, _ in rounds) == result.lookup_rounds > 0
    decoded = Counter({a: n for a, n in enumerate(result.accept_counts) if n})
    walked = Counter(a for _, a in rounds[:-1])
    # the last round may accept past the text's end in decoding (cut there), not in the walk
    last, = (decoded - walked).elements()
    assert walked + Counter([last]) == decoded and last >= rounds[-1][1]


def curve(verify):
    return CostCurve(model="tiny", device="cpu", dtype="torch.float32", threads=1, context=16,
                     greedy_seconds=1.0, catch_up_seconds=0.1, verify_seconds=verify,
                     level_seconds=[0.1, 0.1])


def test_auto_lookup_takes_lookup_on_repetitive_text_and_leaves_fresh_text_alone(llama):
    draft = random_draft(llama)
    costs = curve([1.0 + 0.02 * n for n in range(12)])
    repetitive = [(torch.tensor([5, 6, 7, 8] * 8), 4)]
    fresh = [(torch.arange(40), 4)]
    shape = scored_shape()
    picked = auto_lookup(llama, draft, shape, repetitive, costs=costs)
    assert picked.lookup >= 4 and picked.predicted_speedup > shape.predicted_speedup
    assert auto_lookup(llama, draft, shape, fresh, costs=costs).lookup == 0


def looping_prompt(target):
    """A prompt whose greedy reply repeats n-grams (tiny random models loop), so lookup runs."""
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    return torch.cat([ids, ids], dim=1)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lookup_rounds_keep_greedy_output(target, mode):
    ids = looping_prompt(target)
    expected = greedy_generate(target, ids, 40).tokens
    shape = (TreeShape("chain", depth=3, lookup=4) if mode == "chain"
             else TreeShape("tree", depth=3, top_k=2, total_tokens=6, lookup=4))
    result = generate(target, random_draft(target), ids, 40, shape=shape)
    assert result.tokens == expected
    assert 0 < result.lookup_rounds < result.target_forwards - 1


def test_deferred_catch_up_keeps_the_oracle_draft_perfect(target):
    """After lookup rounds the draft catches up over several rounds' tokens at once; an
    oracle draft that rebuilds its context from its cache still proposes every token right,
    so every draft round is full — a misaligned catch-up would break that."""
    ids = looping_prompt(target)
    expected = greedy_generate(target, ids, 40).tokens
    result = generate(target, oracle_draft(target, ids), ids, 40,
                      shape=TreeShape("chain", depth=3, lookup=2))
    assert result.tokens == expected and result.lookup_rounds > 0
    draft_rounds = result.target_forwards - 1 - result.lookup_rounds
    assert draft_rounds > 2
    assert result.accept_counts[3] >= draft_rounds - 1  # the last round may be cut by length


def test_summary_reports_the_share_of_lookup_rounds():
    import pandas as pd

    base = dict(benchmark="b", turn=1, exact_match=True, match_prefix=5, n_tokens=6)
    records = pd.DataFrame([
        {**base, "prompt_id": "1", "method": "greedy", "seconds": 2.0, "target_forwards": None,
         "lookup_rounds": None},
        {**base, "prompt_id": "1", "method": "draft", "seconds": 1.0, "target_forwards": 5,
         "lookup_rounds": 1}])
    rows = summarize(records, n_bootstrap=10).set_index(["benchmark", "label"])
    assert rows.loc[("all", "draft"), "lookup_share"] == pytest.approx(1 / 4)
    assert pd.isna(rows.loc[("all", "greedy"), "lookup_share"])
