"""Offline acceptance: on the target's own greedy text, the decoding walk over per-root
acceptance gives exactly the τ (and rounds) that chain speculative decoding measures."""
import pandas as pd
import pytest
import torch

from actwave.capture.forward import hidden_states
from actwave.decoding.acceptance import (decode_walk, leading_hits, root_mask, sequence_acceptance,
                                         tau_hat, walk_check)
from actwave.decoding.evaluate import EvalConfig, build_methods, run_item
from actwave.decoding.speculative import generate, greedy_generate
from actwave.decoding.tree import TreeShape
from actwave.eagle3 import Eagle3Draft
from actwave.eagle3.ttt import TTTLoss
from actwave.eagle3.vocab import draft_target_ids
from conftest import tiny_model

LAYERS = (1, 2, 4)


def text_features(target, sequence: torch.Tensor, layers=LAYERS):
    """(L,) ids -> draft input states (L, k·D) and target argmax (L,), one plain forward."""
    with torch.no_grad():
        states = hidden_states(target, sequence[None])  # (N+1, 1, L, D)
        logits = target(input_ids=sequence[None]).logits[0]  # (L, V)
    return torch.cat([states[i, 0] for i in layers], dim=-1), logits.argmax(-1)


def fitted_draft(target, sequence: torch.Tensor, steps: int = 40, seed: int = 0, layers=LAYERS,
                 make=None):
    """A draft (``make()``, else a random-head one on ``layers``) overfitted (TTT loss) to
    the target on one text, so acceptance is long but imperfect: the equality test then
    exercises rounds of every length."""
    torch.manual_seed(seed)
    draft = make() if make else Eagle3Draft.from_target(target, layers, lm_head_init="random")
    states, argmax = text_features(target, sequence, layers)
    with torch.no_grad():
        logits = target(input_ids=sequence[None]).logits.float()  # (1, L, V)
        probs = torch.softmax(logits[..., draft_target_ids(draft.d2t)], -1)  # (1, L, V_draft)
    loss_fn = TTTLoss(draft, ttt_steps=3)
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    label_mask = torch.ones(1, sequence.numel(), dtype=torch.bool)
    label_mask[0, -1] = False
    for _ in range(steps):
        out = loss_fn(states[None], sequence[None], probs, argmax[None], label_mask)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return draft.eval()


@pytest.fixture(scope="module")
def greedy_case():
    # initializer_range 0.3: a random model whose greedy text does not collapse into a loop
    target = tiny_model("llama", initializer_range=0.3)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    new = greedy_generate(target, prompt, max_new_tokens=48).tokens
    sequence = torch.cat([prompt[0], torch.tensor(new)])
    return target, prompt, sequence, fitted_draft(target, sequence)


def offline(draft, target, sequence, prompt_len, depth, top_k=1, layers=LAYERS):
    states, argmax = text_features(target, sequence, layers)
    in_reply = torch.arange(sequence.numel()) >= prompt_len
    return sequence_acceptance(draft, states, sequence, argmax, in_reply, depth, top_k)


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_walk_equals_chain_decoding_tau(greedy_case, depth):
    target, prompt, sequence, draft = greedy_case
    n_new = sequence.numel() - prompt.shape[1]
    spec = generate(target, draft, prompt, n_new, shape=TreeShape("chain", depth=depth))
    assert spec.tokens == sequence[prompt.shape[1]:].tolist()
    result = offline(draft, target, sequence, prompt.shape[1], depth)
    accepted_at = dict(zip(result.roots.tolist(), result.accepted.tolist()))
    tau, rounds = decode_walk(accepted_at, prompt.shape[1], n_new)
    assert rounds == sum(spec.accept_counts)
    assert tau == spec.tau
    assert spec.tau > 1.3  # the fitted draft gets multi-token rounds: the test has teeth


def test_a_stop_token_accepted_inside_a_round_ends_decoding(greedy_case):
    """A stop token accepted before a round's bonus token ends the run in that round, as
    greedy decoding stops there: the same tokens, and the rounds and τ of the walk over the
    text cut after it (a run that went on would waste rounds and report τ < 1)."""
    target, prompt, sequence, draft = greedy_case
    first = prompt.shape[1]
    result = offline(draft, target, sequence, first, depth=3)
    accepted_at = dict(zip(result.roots.tolist(), result.accepted.tolist()))
    reply, root, mid_round = sequence.tolist(), first, None
    while root < len(reply) - 1 and mid_round is None:  # the decoding rounds, in order
        if accepted_at[root] >= 1 and reply[root + 1] not in reply[first:root + 1]:
            mid_round = root + 1  # accepted, not the bonus, and new in the reply
        root += accepted_at[root] + 1
    assert mid_round is not None
    stop = reply[mid_round]
    spec = generate(target, draft, prompt, len(reply) - first,
                    shape=TreeShape("chain", depth=3), eos_token_ids=[stop])
    assert spec.tokens == reply[first:mid_round + 1]
    tau, rounds = decode_walk(accepted_at, first, mid_round + 1 - first)
    assert (spec.target_forwards - 1, spec.tau) == (rounds, tau) and spec.tau >= 1


def test_tau_hat_counts_every_root_and_reached_steps(greedy_case):
    target, prompt, sequence, draft = greedy_case
    result = offline(draft, target, sequence, prompt.shape[1], depth=3)
    n_new = sequence.numel() - prompt.shape[1]
    assert result.n_roots == n_new - 1  # every generated token but the last is a root
    assert tau_hat([result]) == pytest.approx(1 + result.accepted.float().mean().item())
    assert result.reached.tolist() == [int((result.accepted > i).sum()) for i in range(3)]
    assert result.reached[0] >= result.reached[1] >= result.reached[2]


def test_top_k_acceptance_dominates_top_1(greedy_case):
    target, prompt, sequence, draft = greedy_case
    top1 = offline(draft, target, sequence, prompt.shape[1], depth=3, top_k=1)
    top4 = offline(draft, target, sequence, prompt.shape[1], depth=3, top_k=4)
    assert (top4.accepted >= top1.accepted).all()
    assert tau_hat([top4]) > tau_hat([top1])
    states, argmax = text_features(target, sequence)
    in_reply = torch.arange(sequence.numel()) >= prompt.shape[1]
    both = sequence_acceptance(draft, states, sequence, argmax, in_reply, 3, top_k=(1, 4))
    assert torch.equal(both[0].accepted, top1.accepted)  # one unroll, same answers
    assert torch.equal(both[1].accepted, top4.accepted)


def test_non_greedy_text_stops_the_chain():
    """Where the text leaves the target's argmax, the chain cannot go on past it."""
    hits = torch.tensor([[True, True, False], [True, True, True]])
    assert leading_hits(hits).tolist() == [2, 3]
    reply = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    # roots at t+1 = 2, 3, 4 (x_{t+2} must be a reply token too)
    assert root_mask(reply)[0].nonzero().squeeze(1).add(1).tolist() == [2, 3, 4]


def test_decode_walk_jumps_by_accepted_plus_one():
    accepted = {10: 2, 13: 0, 14: 3, 18: 1, 19: 0, 20: 5}
    tau, rounds = decode_walk(accepted, first=10, n_new=11)
    # roots 10 (+3) 13 (+1) 14 (+4) 18 (+2) -> 11 tokens emitted after 4 rounds
    assert rounds == 4 and tau == pytest.approx(10 / 4)


def test_bad_input_is_refused(greedy_case):
    target, _, sequence, draft = greedy_case
    states, argmax = text_features(target, sequence)
    reply = torch.ones_like(sequence, dtype=torch.bool)
    with pytest.raises(ValueError, match="depth and top_k"):
        sequence_acceptance(draft, states, sequence, argmax, reply, depth=0)
    with pytest.raises(ValueError, match=">= 3 tokens"):
        sequence_acceptance(draft, states[:2], sequence[:2], argmax[:2], reply[:2], depth=2)


class _PromptTokenizer:
    """Every conversation tokenises to one fixed prompt (the greedy case's)."""

    def __init__(self, ids):
        self.ids = ids

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return {"input_ids": list(self.ids)}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_walk_check_equals_chain_decoding_on_the_decoded_records(greedy_case):
    target, prompt, sequence, draft = greedy_case
    config = EvalConfig(mode="chain", depth=3, max_new_tokens=sequence.numel() - prompt.shape[1],
                        peers=False)
    methods = build_methods(target, {"fitted": draft}, config, eos=[])
    item = {"benchmark": "sharegpt", "prompt_id": "p0", "turns": ["hello"]}
    records = pd.DataFrame(run_item(item, _PromptTokenizer(prompt[0].tolist()), methods, config,
                                    torch.device("cpu")))
    table = walk_check(target, {"fitted": draft}, records, depth=3)
    assert table["equal"].tolist() == [True] and table["decoding_tau"].iloc[0] > 1.3
    broken = records.copy()
    broken.at[1, "accept_counts"] = [c + 1 for c in broken.at[1, "accept_counts"]]
    assert walk_check(target, {"fitted": draft}, broken, depth=3)["equal"].tolist() == [False]
    broken.at[0, "prompt_ids"] = None
    with pytest.raises(ValueError, match="holds no prompt_ids"):
        walk_check(target, {"fitted": draft}, broken, depth=3)
