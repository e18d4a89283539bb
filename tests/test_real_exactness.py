"""On the real bundled SmolLM2-135M, fp32: speculative output equals greedy output under every
linear route (chain and tree), and the offline decoding walk over per-position acceptance
gives exactly the decoding τ on the same greedy text — the check the study's records allow."""
import contextlib

import pytest
import torch

from actwave.capture import data
from actwave.capture.models import stop_token_ids
from actwave.decoding import linear_routes
from actwave.decoding.acceptance import decode_walk
from actwave.decoding.evaluate import benchmark_prompts
from actwave.decoding.speculative import generate, greedy_generate
from actwave.decoding.tree import TreeShape
from actwave.eagle3 import Eagle3Draft
from test_acceptance import fitted_draft, offline
from test_linear_routes import table_of

LAYERS = (2, 15, 27)  # EAGLE-3's default (2, N//2, N−3) for N = 30
SHAPES = {"chain": TreeShape("chain", depth=3), "tree": TreeShape("tree", 3, 3, 8)}


@pytest.fixture(scope="module")
def real_case(smollm2):
    """SmolLM2, a short held-out prompt, its 40-token greedy reply, and a draft fitted to that
    text (acceptance long but imperfect, so rounds of every length occur)."""
    target, tokenizer = smollm2
    eos = stop_token_ids(tokenizer, "smollm2-135m")
    prompts = [data.prompt_ids(tokenizer, [{"role": "user", "content": data.first_prompt(row["messages"])}])
               for row in data.sharegpt_split("eval", 20)]
    prompt = torch.tensor([next(p for p in prompts if 16 <= len(p) <= 80)])
    reply = greedy_generate(target, prompt, 40, eos).tokens
    sequence = torch.cat([prompt[0], torch.tensor(reply)])
    counts = torch.bincount(sequence, minlength=target.get_input_embeddings().weight.shape[0])
    draft = fitted_draft(target, sequence, steps=30, layers=LAYERS,
                         make=lambda: Eagle3Draft.from_target(
                             target, LAYERS, draft_vocab_size=512, token_counts=counts.float()))
    return target, prompt, reply, sequence, draft, eos


@contextlib.contextmanager
def under(routes: str, target, draft):
    """"stock": nothing changed; "measured": this machine's tables; a route name: that route
    for every row count of the target and the draft."""
    if routes in ("stock", "measured"):
        with linear_routes.routed({"smollm2-135m": target, "draft": draft}
                                  if routes == "measured" else {}):
            yield
        return
    if routes not in linear_routes.available_routes(target.lm_head.weight):
        pytest.skip(f"route {routes!r} does not run in this PyTorch build")
    every_row_count = table_of(routes, linear_routes.ROW_COUNTS)
    with linear_routes.use_routes(target, every_row_count), \
            linear_routes.use_routes(draft, every_row_count):
        yield


@pytest.mark.parametrize("routes", ["stock", "measured", *linear_routes.ROUTES])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_speculative_equals_greedy_on_smollm2_under_each_route(real_case, shape, routes):
    target, prompt, reply, _, draft, eos = real_case
    with under(routes, target, draft):
        greedy = greedy_generate(target, prompt, len(reply), eos).tokens
        spec = generate(target, draft, prompt, len(reply), eos_token_ids=eos, shape=SHAPES[shape])
    assert spec.tokens == greedy == reply
    assert spec.tau > 1.2  # the fitted draft is accepted: multi-token rounds are exercised


def test_offline_walk_equals_decoding_tau_on_smollm2(real_case):
    target, prompt, reply, sequence, draft, eos = real_case
    spec = generate(target, draft, prompt, len(reply), eos_token_ids=eos, shape=SHAPES["chain"])
    result = offline(draft, target, sequence, prompt.shape[1], depth=3, layers=LAYERS)
    walk_tau, rounds = decode_walk(dict(zip(result.roots.tolist(), result.accepted.tolist())),
                                   prompt.shape[1], len(reply))
    assert rounds == sum(spec.accept_counts) and walk_tau == spec.tau


def test_lookup_rounds_equal_greedy_on_a_humaneval_prompt(smollm2, real_case):
    """A HumanEval reply restates its prompt's code, so lookup rounds run; under the measured
    routes the output is still SmolLM2's greedy reply."""
    (target, tokenizer), draft, eos = smollm2, real_case[4], real_case[5]
    item = benchmark_prompts("humaneval", 1)[0]
    prompt = torch.tensor([data.prompt_ids(tokenizer, [{"role": "user", "content": item["turns"][0]}])])
    with under("measured", target, draft):
        greedy = greedy_generate(target, prompt, 48, eos).tokens
        spec = generate(target, draft, prompt, 48, eos_token_ids=eos,
                        shape=TreeShape("tree", 1, 2, 3, lookup=8))
    assert spec.tokens == greedy
    assert spec.lookup_rounds > 0 and spec.tau > 1.2
