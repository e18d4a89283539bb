"""Speculative decoding: greedy exactness (chain/tree, random and oracle drafts, EOS, max
length; Llama, Qwen3, Gemma3 with sliding windows), tree mechanics, sampling in law, errors."""
import time

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import chisquare
from transformers import DynamicCache

from actwave.decoding.costmodel import CostCurve, auto_shape
from actwave.decoding import evaluate as harness, timing
from actwave.decoding.evaluate import EvalConfig, build_methods, evaluate, run_item
from actwave.decoding.report import (acceptance_by_position, bootstrap_ci, read_selection_scores,
                                     summarize, tau_vs_scores)
from actwave.decoding.speculative import (accept_greedy, generate, greedy_generate, keep_cache_rows,
                                          packed_gqa_attention)
from actwave.decoding.timing import SectionClock
from actwave.decoding.tree import DraftTree, TreeShape, ancestor_mask, build_tree, target_tree_mask
from actwave.eagle3 import Eagle3Draft
from conftest import tiny_model

SETTINGS = {"chain": TreeShape("chain", depth=5),
            "tree": TreeShape("tree", depth=4, top_k=3, total_tokens=10)}


# Sliding window 6 < sequence length, mixed layer types: exercises the dict tree mask.
GEMMA_WINDOWS = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2)


def make_target(kind: str, **changes):
    return tiny_model(kind, **(GEMMA_WINDOWS if kind == "gemma3" else {}), **changes)


class OracleDraft(Eagle3Draft):
    """TEST ONLY: proposes the target's own next token at every draft row.

    Each row's context is rebuilt from the draft cache slots its mask lets it see, so a
    correct tree/cache implementation makes every proposal right (long accepted runs that
    exercise the cache rollback). ``swap_every`` > 0 swaps the top two proposals at
    positions divisible by it, so trees must accept non-first siblings.
    """

    def attach(self, target, first_token: int, swap_every: int = 0):
        object.__setattr__(self, "oracle_target", target)  # not a submodule
        self.first_token, self.swap_every, self.slot_inputs = first_token, swap_every, []
        return self

    def forward(self, input_ids, hidden, position_ids, attention_mask=None, past_key_values=None,
                logits_to_keep=0):
        past = past_key_values.get_seq_length()
        out = super().forward(input_ids, hidden, position_ids, attention_mask, past_key_values)
        del self.slot_inputs[past:]
        self.slot_inputs += input_ids[0].tolist()
        rows = []
        for row in range(input_ids.shape[1]):
            visible = (range(past + row + 1) if attention_mask is None
                       else (attention_mask[0, 0, row] == 0).nonzero()[:, 0].tolist())
            context = [self.first_token] + [self.slot_inputs[j] for j in visible]
            ranked = self.oracle_target(torch.tensor([context])).logits[0, -1].topk(2).indices
            if self.swap_every and int(position_ids[0, row]) % self.swap_every == 0:
                ranked = ranked.flip(0)
            # Confident proposals (log-probs ≈ −0.3, −1.3) so EAGLE-2 grows deep paths.
            logits = torch.zeros(self.config.draft_vocab_size)
            logits[ranked] = torch.tensor([12.0, 11.0])
            rows.append(logits)
        out.logits = torch.stack(rows)[None, -logits_to_keep:]  # (1, T or kept, V_draft)
        return out


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def target(request):
    """conftest's targets, but Gemma3 with mixed sliding-window layers (``GEMMA_WINDOWS``)."""
    return make_target(request.param)


def random_draft(target, layer_ids=(1, 2, 4), draft_vocab_size=96):
    torch.manual_seed(1)
    return Eagle3Draft.from_target(target, layer_ids, draft_vocab_size=draft_vocab_size).eval()


def oracle_draft(target, prompt, swap_every=0):
    torch.manual_seed(1)
    draft = OracleDraft.from_target(target, (1, 4)).eval()
    return draft.attach(target, int(prompt[0, 0]), swap_every)


def prompt(seed=3, length=9):
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_random_draft_matches_greedy(target, mode):
    ids = prompt()
    expected = greedy_generate(target, ids, 24).tokens
    result = generate(target, random_draft(target), ids, 24, shape=SETTINGS[mode])
    assert result.tokens == expected
    assert sum(result.accept_counts) == result.target_forwards - 1
    assert result.tau == pytest.approx(23 / (result.target_forwards - 1))


def flat_costs(n_max=16, width=4):
    """A made-up cost curve on which bigger trees cost almost nothing more (auto goes wide)."""
    return CostCurve(model="tiny", device="cpu", dtype="torch.float32", threads=1, context=16,
                     greedy_seconds=1.0, catch_up_seconds=0.1,
                     verify_seconds=[1.0 + 0.01 * n for n in range(1, n_max + 1)],
                     level_seconds=[0.1 + 0.01 * w for w in range(1, width + 1)])


@pytest.mark.parametrize("acceptance,mode", [([0.9, 0.8, 0.7], "chain"),
                                             ({1: [0.6, 0.4, 0.3], 4: [0.95, 0.9, 0.85]}, "tree")])
def test_auto_tree_matches_greedy_and_reports_its_shape(target, acceptance, mode):
    ids = prompt(seed=4)
    expected = greedy_generate(target, ids, 30).tokens
    draft = oracle_draft(target, ids, swap_every=3)
    shape = auto_shape(target, draft, acceptance, costs=flat_costs())
    result = generate(target, draft, ids, 30, shape=shape)
    assert result.tokens == expected
    assert result.shape == shape and shape.mode == mode
    assert shape.depth == 3 and shape.predicted_speedup > 1
    if mode == "tree":
        assert shape.top_k == 4 and shape.total_tokens > 4
        assert sum(result.accept_counts[2:]) > 0


def test_packed_gqa_attention_equals_repeated_heads():
    """Packing the queries of a group against its one key/value head = HF's repeat_kv route."""
    class Module:
        num_key_value_groups = 3
    query = torch.randn(1, 6, 5, 8)
    key, value = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    allowed = torch.rand(5, 9) > 0.3
    allowed[:, 0] = True
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    out, _ = packed_gqa_attention(Module(), query, key, value, mask, scaling=0.3)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, reference.transpose(1, 2))


def test_packed_mask_is_made_once_per_mask_and_never_reused_for_another():
    """Layers of one forward share the mask object: one repeat serves them all; a new mask
    (a later round, the same shape) gets its own repeat, not the stale one."""
    class Module:
        num_key_value_groups = 3
    query = torch.randn(1, 6, 2, 8)
    key, value = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    def mask_blocking(column):
        allowed = torch.ones(2, 4, dtype=torch.bool)
        allowed[:, column] = False
        return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]

    def reference(mask):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask,
            scale=0.3).transpose(1, 2)

    outputs = []
    for blocked in (1, 2):  # two masks of one shape in turn, each blocking another cached key
        mask = mask_blocking(blocked)
        first, _ = packed_gqa_attention(Module(), query, key, value, mask, scaling=0.3)
        again, _ = packed_gqa_attention(Module(), query, key, value, mask, scaling=0.3)
        torch.testing.assert_close(first, reference(mask))
        assert torch.equal(first, again)
        outputs.append(first)
    assert not torch.allclose(outputs[0], outputs[1])
    sliding, full = mask_blocking(0), mask_blocking(3)  # two live masks alternating (Gemma-3)
    for mask in (sliding, full, sliding, full):
        out, _ = packed_gqa_attention(Module(), query, key, value, mask, scaling=0.3)
        torch.testing.assert_close(out, reference(mask))


@pytest.mark.parametrize("mode,swap_every", [("chain", 0), ("tree", 0), ("tree", 3)])
def test_oracle_draft_long_acceptance_matches_greedy(target, mode, swap_every):
    ids = prompt(seed=4)
    expected = greedy_generate(target, ids, 30).tokens
    result = generate(target, oracle_draft(target, ids, swap_every), ids, 30, shape=SETTINGS[mode])
    assert result.tokens == expected
    depth = SETTINGS[mode].depth
    if swap_every:  # every 3 consecutive positions hold a swap: runs of 3 take a 2nd sibling
        assert sum(result.accept_counts[3:]) > 0 and result.tau > 2.5
    else:  # a perfect draft fills every round (the last one may be cut by max length)
        assert result.accept_counts[depth] >= result.target_forwards - 2
        assert result.tau > depth - 0.5


def test_chain_rejections_with_swapped_oracle(llama):
    ids = prompt(seed=4)
    expected = greedy_generate(llama, ids, 30).tokens
    result = generate(llama, oracle_draft(llama, ids, swap_every=3), ids, 30, shape=TreeShape("chain", depth=5))
    assert result.tokens == expected
    assert 1.0 < result.tau < 5.0  # some rounds stop at the swapped position


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_stops_at_eos_inside_an_accepted_run(llama, mode):
    ids = prompt(seed=4)
    reference = greedy_generate(llama, ids, 30).tokens
    # a stop token first seen mid-reply (the reply's first token would stop at the prefill)
    first = next(i for i, token in enumerate(reference) if i >= 3 and token not in reference[:i])
    eos = reference[first]
    greedy = greedy_generate(llama, ids, 30, eos_token_ids=[eos])
    assert greedy.tokens == reference[: first + 1] and greedy.target_forwards == first + 1
    result = generate(llama, oracle_draft(llama, ids), ids, 30, eos_token_ids=[eos], shape=SETTINGS[mode])
    assert result.tokens == greedy.tokens
    assert result.target_forwards < greedy.target_forwards  # the oracle's rounds end there too


@pytest.mark.parametrize("max_new_tokens", [1, 2, 8])
def test_max_new_tokens_cuts_inside_a_round(llama, max_new_tokens):
    ids = prompt(seed=4)
    expected = greedy_generate(llama, ids, max_new_tokens).tokens
    result = generate(llama, oracle_draft(llama, ids), ids, max_new_tokens, shape=TreeShape("chain", depth=5))
    assert result.tokens == expected and len(expected) == max_new_tokens


# ----------------------------------------------------------------------------- mechanics
def small_tree():
    # root 0 -> children 1, 2 ; 2 -> 3 ; 3 -> 4
    return DraftTree(tokens=torch.tensor([5, 6, 7, 8, 9]), depths=torch.tensor([0, 1, 1, 2, 3]),
                     parents=[-1, 0, 0, 2, 3], children=[[1, 2], [], [3], [4], []])


def test_ancestor_mask_matches_paths():
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                             [1, 0, 1, 1, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(ancestor_mask(small_tree().parents), expected)


def test_accept_greedy_takes_second_sibling_and_bonus():
    logits = torch.zeros(5, 16)
    for node, choice in enumerate([7, 1, 8, 3, 0]):  # target argmax after each node
        logits[node, choice] = 1.0
    path, bonus = accept_greedy(small_tree(), logits)
    assert path == [0, 2, 3] and bonus == 3


def test_keep_cache_rows_gathers_accepted_rows_in_order():
    cache = DynamicCache()
    keys = torch.arange(8.0).view(1, 1, 8, 1)
    cache.update(keys, -keys, 0)
    keep_cache_rows(cache, 3, torch.tensor([0, 2, 4]))
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 3, 5, 7]
    assert cache.layers[0].values.flatten().tolist() == [0, -1, -2, -3, -5, -7]


def test_keep_cache_rows_of_a_chain_prefix_only_slices():
    cache = DynamicCache()
    keys = torch.arange(8.0).view(1, 1, 8, 1)
    cache.update(keys, -keys, 0)
    before = cache.layers[0].keys
    keep_cache_rows(cache, 3, torch.tensor([0, 1, 2]))
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert cache.layers[0].keys.data_ptr() == before.data_ptr()  # a view: nothing was copied
    assert keys.flatten().tolist() == list(range(8))  # rows past the kept ones untouched


def test_sliding_window_tree_mask():
    config = make_target("gemma3").config
    masks = target_tree_mask(small_tree(), 6, config, torch.float32)
    full, sliding = (masks[k][0, 0] == 0 for k in ("full_attention", "sliding_attention"))
    assert full.shape == (5, 11) and full[4, :6].all() and not full[4, 7]
    # node 4 sits at position 9: window 6 sees positions 4..9 only
    assert sliding[4].tolist() == [False] * 4 + [True] * 2 + [True, False, True, True, True]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_build_tree_budget_closure_and_cache_restore(llama, temperature):
    draft = random_draft(llama)
    cache = DynamicCache()
    states = torch.randn(1, 5, 3 * 64)
    out = draft(prompt()[:, :5], draft.fuse(states), torch.arange(5)[None], None, cache)
    tree, forwards = build_tree(draft, cache, 11, out.logits[0, -1], out.hidden[0, -1], depth=4,
                                top_k=3, total_tokens=10, temperature=temperature,
                                generator=torch.Generator().manual_seed(0))
    assert len(tree) == 10 and forwards == 3 and cache.get_seq_length() == 5
    assert int(tree.tokens[0]) == 11 and tree.parents[0] == -1
    assert all(tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1
               for i in range(1, 10))
    assert int(tree.depths.max()) <= 4 and all(len(c) <= 3 for c in tree.children)


# ----------------------------------------------------------------------------- sampling
def peaked_target():
    target = tiny_model("llama", vocab_size=8)
    with torch.no_grad():
        target.lm_head.weight.normal_(0.0, 1.0)  # spread logits: a non-uniform target law
    return target


def exact_marginals(target, ids):
    """P(x2), P(x3) of the target's own sampling at T=1, by enumerating x1, x2."""
    vocab = 8
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1].double(), -1)  # (V,)
        firsts = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2 = torch.softmax(target(firsts).logits[:, -1].double(), -1)  # (V, V)
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (V², 2)
        seconds = torch.cat([ids.expand(vocab * vocab, -1), pairs], 1)
        p3 = torch.softmax(target(seconds).logits[:, -1].double(), -1)  # (V², V)
    joint12 = p1[:, None] * p2  # (V, V)
    return joint12.sum(0), (joint12.reshape(-1, 1) * p3).sum(0)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_preserves_target_distribution(mode):
    target = peaked_target()
    ids = torch.tensor([[1, 5, 2, 7]])
    torch.manual_seed(2)
    draft = Eagle3Draft.from_target(target, (2, 4), lm_head_init="random").eval()
    p_second, p_third = exact_marginals(target, ids)
    runs = 700
    counts = np.zeros((2, 8))
    accepted_any = 0
    for seed in range(runs):
        result = generate(target, draft, ids, 3, shape=TreeShape(mode, 2, 3, 6),
                          temperature=1.0, seed=seed)
        counts[0, result.tokens[1]] += 1
        counts[1, result.tokens[2]] += 1
        accepted_any += result.accept_counts[0] < sum(result.accept_counts)
    assert 0 < accepted_any < runs  # both acceptance and rejection paths ran
    for observed, expected in zip(counts, (p_second, p_third)):
        assert chisquare(observed, expected.numpy() * runs).pvalue > 1e-3
        assert 0.5 * np.abs(observed / runs - expected.numpy()).sum() < 0.08


# ----------------------------------------------------------------------------- errors
def test_draft_for_another_target_is_refused(llama):
    other = make_target("llama", hidden_size=32, intermediate_size=64)
    draft = random_draft(other, draft_vocab_size=64)
    with pytest.raises(ValueError, match="hidden size 64 != draft's target_hidden_size 32"):
        generate(llama, draft, prompt(), 4)


@pytest.mark.parametrize("ids,max_new,match", [
    (torch.zeros(1, 0, dtype=torch.long), 4, "empty prompt"),
    (torch.zeros(2, 5, dtype=torch.long), 4, "batch size 1"),
    (torch.zeros(5, dtype=torch.long), 4, r"\(1, T\)"),
    (torch.zeros(1, 5, dtype=torch.long), 0, "max_new_tokens must be a positive int"),
])
def test_bad_inputs_are_refused(llama, ids, max_new, match):
    draft = random_draft(llama)
    with pytest.raises(ValueError, match=match):
        generate(llama, draft, ids, max_new)
    with pytest.raises(ValueError, match=match):
        greedy_generate(llama, ids, max_new)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(shape={"mode": "tree"}), "shape must be a TreeShape"),
    (dict(shape=TreeShape(lookup=2), temperature=0.7), "needs temperature 0"),
])
def test_bad_settings_are_refused(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(llama, random_draft(llama), prompt(), 4, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="beam"), "mode must be one of"), (dict(depth=0), "depth must be an int >= 1"),
    (dict(total_tokens=1), "total_tokens must be an int >= 2"),
    (dict(lookup=-1), "lookup must be an int >= 0"),
])
def test_bad_tree_shapes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeShape(**kwargs)


def test_chain_shape_fixes_its_width():
    assert TreeShape("chain", depth=5).settings() == dict(mode="chain", depth=5, top_k=1,
                                                           total_tokens=6, lookup=0)


@pytest.mark.parametrize("acceptance,match", [
    (None, "auto_shape needs acceptance"), ([0.5, -0.1], r"acceptance\[1\] must be")])
def test_auto_shape_refuses_bad_acceptance(llama, acceptance, match):
    with pytest.raises(ValueError, match=match):
        auto_shape(llama, random_draft(llama), acceptance, costs=flat_costs())


# ----------------------------------------------------------------------------- harness
def synthetic_records():
    """Two prompts × (greedy, a draft); hand-computable sums."""
    rows = []
    for prompt_id, (g_sec, d_sec, d_fw) in {"a": (4.0, 2.0, 5), "b": (6.0, 2.0, 3)}.items():
        rows.append(dict(benchmark="mtbench", prompt_id=prompt_id, turn=1, method="greedy",
                         n_tokens=9, seconds=g_sec, exact_match=True, match_prefix=9,
                         target_forwards=None,
                         accept_counts=None))
        rows.append(dict(benchmark="mtbench", prompt_id=prompt_id, turn=1, method="draft",
                         n_tokens=9, seconds=d_sec, exact_match=prompt_id == "a",
                         match_prefix=9 if prompt_id == "a" else 3,
                         target_forwards=d_fw, accept_counts=[1, 1, 2] if d_fw == 5 else [0, 0, 2]))
    return pd.DataFrame(rows)


def test_summarize_ratio_of_sums_and_ci():
    summary = summarize(synthetic_records(), n_bootstrap=400, seed=0)
    row = summary[(summary.benchmark == "mtbench") & (summary.label == "draft")].iloc[0]
    assert row.tokens_per_s == pytest.approx(18 / 4)
    assert row.speedup == pytest.approx((18 / 4) / (18 / 10))
    assert row.tau == pytest.approx(16 / 6)  # emitted (n−1) over rounds (forwards − 1)
    assert row.exact_match_rate == 0.5 and row.match_prefix_frac == pytest.approx(12 / 18)
    # bootstrap support: single-prompt resamples give speedups 2.0 (a) and 3.0 (b)
    assert 2.0 <= row.speedup_lo <= row.speedup <= row.speedup_hi <= 3.0
    greedy = summary[(summary.benchmark == "all") & (summary.label == "greedy")].iloc[0]
    assert greedy.speedup == 1.0 and np.isnan(greedy.tau)


def test_bootstrap_ci_matches_direct_resampling():
    values = np.arange(10.0)
    low, high = bootstrap_ci(lambda idx: values[idx].mean(-1), 10, 2000, seed=1)
    rng = np.random.default_rng(1)
    direct = [values[rng.integers(0, 10, 10)].mean() for _ in range(2000)]
    assert low == pytest.approx(np.percentile(direct, 2.5), abs=0.15)
    assert high == pytest.approx(np.percentile(direct, 97.5), abs=0.15)


def test_acceptance_by_position_from_histograms():
    table = acceptance_by_position(synthetic_records())
    # pooled histogram [1, 1, 4] over 6 rounds: P(>=1) = 5/6, P(>=2) = 4/6, P(>=3) = 0
    assert table.position.tolist() == [1, 2, 3]
    assert table.reach.tolist() == pytest.approx([5 / 6, 4 / 6, 0.0])
    assert table.conditional.tolist() == pytest.approx([5 / 6, 4 / 5, 0.0])


class StubTokenizer:
    """Chat template = concatenated token ids of 'u:<text>' / 'a:<text>' turns."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        text = "".join(f"{m['role'][0]}:{m['content']}|" for m in messages)
        return {"input_ids": [ord(c) % 128 for c in text + ("a:" if add_generation_prompt else "")]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_run_item_second_turn_sees_greedy_answer(llama):
    config = EvalConfig(max_turns=2, max_new_tokens=6, peers=False, mode="chain", depth=3)
    methods = build_methods(llama, {"draft": random_draft(llama)}, config, eos=[])
    item = {"benchmark": "mtbench", "prompt_id": "1", "turns": ["hi", "more"]}
    records = run_item(item, StubTokenizer(), methods, config, torch.device("cpu"))
    assert [(r["turn"], r["method"]) for r in records] == [
        (1, "greedy"), (1, "draft"), (2, "greedy"), (2, "draft")]
    assert all(r["exact_match"] and r["n_tokens"] == 6 for r in records)
    answer = StubTokenizer().decode(records[0]["tokens"])
    expected_turn2 = len("u:hi|a:" + answer + "|u:more|a:")
    assert records[2]["prompt_tokens"] == expected_turn2


def _busy(seconds: float) -> None:
    """Spend CPU time (a method computing), unlike time.sleep (a stopped process)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.parametrize("stops, calls", [(0, 1), (1, 2), (5, 3)])
def test_a_measurement_the_process_slept_through_is_timed_again(monkeypatch, stops, calls):
    """A stop (SIGSTOP, a suspended machine) looks like time.sleep: wall time, no CPU time.
    Such a measurement is retaken, at most STALL_RETRIES times; a computing one is kept."""
    monkeypatch.setattr(timing, "STALL_MIN_SECONDS", 0.05)
    made = []

    def method(input_ids):
        made.append(1)
        time.sleep(0.2) if len(made) <= stops else _busy(0.02)
        return {"tokens": [1]}

    out = harness._timed(method, torch.zeros(1, 1, dtype=torch.long))
    assert len(made) == calls
    assert (out["seconds"] >= 0.2) == (stops >= calls)
    assert not timing.stalled(0.2, 0.0, torch.device("meta"))  # only CPU targets are checked


def test_tau_vs_scores_reads_selection_csv_and_ranks(tmp_path):
    rows = [{"model": "m", "token_set": s, "label": f"x{i}", "layer_ids": f"{i},{i + 1}",
             "renyi2": float(i) if s == "all tokens" else float(-i), "renyi2_pct": 10.0 * i}
            for s in ("all tokens", "filtered") for i in range(4)]
    pd.DataFrame(rows).to_csv(tmp_path / "05_selection.csv", index=False)
    scores = read_selection_scores(tmp_path / "05_selection.csv")
    assert set(scores["score"]) == {"renyi2", "renyi2_pct"}
    assert scores["layer_ids"].iloc[0] == (0, 1)
    taus = pd.DataFrame({"model": "m", "label": [f"d{i}" for i in range(4)],
                         "layer_ids": [(i, i + 1) for i in range(4)], "tau": [1.0, 1.5, 1.7, 2.4]})
    joined, correlations = tau_vs_scores(taus, scores)
    assert len(joined) == 4 * 4  # 4 drafts × 2 token sets × 2 score columns
    by_key = correlations.set_index(["model", "token_set", "score"])
    assert by_key.loc[("m", "all tokens", "renyi2"), "spearman"] == pytest.approx(1.0)
    assert by_key.loc[("m", "filtered", "renyi2"), "kendall"] == pytest.approx(-1.0)
    assert by_key.loc[("all", "filtered", "renyi2"), "spearman"] == pytest.approx(-1.0)


def test_evaluate_resumes_only_records_of_the_same_draft_weights(llama, tmp_path):
    """Records are keyed by the drafts' weights: a retrained draft on the same layers is
    evaluated afresh, the unchanged one is resumed (no method is run again)."""
    config = EvalConfig(benchmarks=("humaneval",), n_prompts=1, max_turns=1, max_new_tokens=4,
                        peers=False, mode="chain", depth=2, n_bootstrap=10)
    draft = random_draft(llama)
    first = evaluate(llama, StubTokenizer(), {"d": draft}, config, [], out_dir=tmp_path)
    assert len(list(tmp_path.glob("*/manifest.json"))) == 1 and len(first["records"]) == 2
    again = evaluate(llama, StubTokenizer(), {"d": draft}, config, [], out_dir=tmp_path)
    for column in ("method", "seconds", "tokens"):  # loaded, not re-timed
        assert again["records"][column].tolist() == first["records"][column].tolist()
    pd.testing.assert_frame_equal(again["summary"], first["summary"])
    retrained = random_draft(llama)
    with torch.no_grad():
        retrained.fc.weight.add_(0.01)
    assert retrained.fingerprint() != draft.fingerprint()
    evaluate(llama, StubTokenizer(), {"d": retrained}, config, [], out_dir=tmp_path)
    assert len(list(tmp_path.glob("*/manifest.json"))) == 2


def test_section_clock_adds_laps_to_their_section_and_refuses_unknown_ones():
    clock = SectionClock(torch.device("cpu"), ("draft", "verify"))
    tick = clock.lap("draft", clock.start)
    time.sleep(0.02)  # a known lower bound for the section it lands in
    tick = clock.lap("verify", tick)
    timings = clock.finish()
    assert set(timings) == {"draft", "verify", "total"}
    assert timings["verify"] >= 0.02 > timings["draft"]
    assert timings["draft"] + timings["verify"] <= timings["total"]
    with pytest.raises(ValueError, match="unknown timing section 'accept'.*'draft', 'verify'"):
        clock.lap("accept", tick)
