"""Hardware-aware tree sizing: the measured cost of a speculative round, cached per machine.

A round of ``actwave.decoding.speculative.generate`` costs a draft catch-up pass, one draft
expansion per tree level beyond the first, and a verification (target forward over the n
tree tokens, then acceptance and cache bookkeeping). ``measure_costs`` times each of
those with the very functions ``generate`` calls, on a cache of ``context`` tokens, and
one plain greedy step beside them; ``load_or_measure`` keeps the curve in the actwave
cache per (model, device, dtype, threads, draft shape), so it is measured once.
``auto_shape`` combines it with the draft's per-depth acceptance (held-out data, e.g.
``actwave.decoding.acceptance``) and picks the tree with the most expected tokens per second
(``actwave.decoding.tree.choose_shape``, in the spirit of Sequoia and EAGLE-2's dynamic trees).
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from actwave.capture.data import prompt_ids
from actwave.capture.forward import forward_with_states
from actwave.capture.models import slug
from actwave.config import artifact_dir, atomic_write_json
from actwave.decoding import linear_routes
from actwave.decoding.acceptance import text_acceptance
from actwave.decoding.evaluate import benchmark_prompts
from actwave.decoding.lookup import score_walk
from actwave.decoding.speculative import accept_round, greedy_generate, verify_forward
from actwave.decoding.timing import synchronize
from actwave.decoding.tree import (DraftTree, TreeShape, build_tree, choose_shape, rank_acceptance,
                                   score_shape, token_chain)

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LOOKUP_TOKENS = (1, 2, 3, 4, 6, 8)  # lookup chain lengths auto_lookup weighs against none


@dataclass
class CostCurve:
    """Seconds of each part of a round, measured on a ``context``-token cache.

    verify_seconds[n−1]: verification over n tree tokens (forward + acceptance + cache
    bookkeeping), linearly interpolated between the measured ``SIZES``; level_seconds[w−1]:
    one draft expansion over w frontier rows (``build_tree`` at depth 2: forward, top-k,
    candidate bookkeeping); catch_up_seconds: the
    draft's catch-up pass over 2 rows; greedy_seconds: one plain greedy decoding step.
    """

    model: str
    device: str
    dtype: str
    threads: int
    context: int
    greedy_seconds: float
    catch_up_seconds: float
    verify_seconds: list[float]
    level_seconds: list[float]


def median_seconds(fn, repeats: int, device) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        tic = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def trim_cache(cache, length: int) -> None:
    """Drop cache rows past ``length`` (HF's crop takes minus the rows to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def chain_tree(n: int, device) -> DraftTree:
    """A chain of n random tokens (verification cost depends on n, not on the shape)."""
    return token_chain(torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).to(device))


def _interpolate(measured: dict[int, float], upto: int) -> list[float]:
    """Seconds for n = 1..upto, linear between measured sizes."""
    sizes = sorted(measured)
    out = []
    for n in range(1, upto + 1):
        high = next(s for s in sizes if s >= n)
        low = max([s for s in sizes if s <= n], default=high)
        frac = 0.0 if high == low else (n - low) / (high - low)
        out.append(measured[low] + frac * (measured[high] - measured[low]))
    return out


@torch.no_grad()
def measure_costs(target, draft, context: int = 256, max_tokens: int = 64, max_width: int = 8,
                  repeats: int = 5) -> CostCurve:
    """Time every part of a round on ``target``/``draft`` (see ``CostCurve``).

    Sizes are interleaved within each repeat so machine noise hits them alike; the
    median over ``repeats`` is kept.
    """
    device = draft.fc.weight.device
    ids = torch.randint(0, 100, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    greedy_cache, cache, draft_cache = DynamicCache(config=target.config), DynamicCache(), DynamicCache()
    target(input_ids=ids, cache=greedy_cache, use_cache=True, logits_to_keep=1)
    _, states, _ = forward_with_states(target, draft.layer_ids, ids, logits_to_keep=1, cache=cache)
    fused = draft.fuse(states.to(draft.fc.weight.dtype))
    out = draft(ids, fused, torch.arange(context, device=device)[None], None, draft_cache,
                logits_to_keep=1)
    hidden = out.hidden[0, -1]

    def greedy():
        target(input_ids=ids[:, -1:], cache=greedy_cache, use_cache=True)
        trim_cache(greedy_cache, context)

    def verify(n):
        tree = chain_tree(n, device)
        logits, tree_states = verify_forward(target, draft.layer_ids, tree, cache, context)
        accept_round(tree, logits, tree_states, cache, context)
        trim_cache(cache, context)

    def catch_up():
        draft(ids[:, -2:], draft.fuse(states[:, -2:].to(fused.dtype)),
              torch.arange(context - 2, context, device=device)[None], None, draft_cache,
              logits_to_keep=1)
        trim_cache(draft_cache, context)

    def level(width):  # a depth-2 tree = one expansion over ``width`` rows (+ its top-k)
        build_tree(draft, draft_cache, 0, out.logits[0, -1], hidden, depth=2, top_k=width,
                   total_tokens=2)

    sizes = [s for s in SIZES if s <= max_tokens] + ([max_tokens] if max_tokens not in SIZES else [])
    tasks = ({("greedy", 1): greedy, ("catch_up", 2): catch_up}
             | {("verify", n): (lambda n=n: verify(n)) for n in sizes}
             | {("level", w): (lambda w=w: level(w)) for w in range(1, max_width + 1)})
    for fn in tasks.values():  # warm-up: allocator, thread pools, first-call paths
        fn()
    times: dict = {key: [] for key in tasks}
    for _ in range(repeats):
        for key, fn in tasks.items():
            times[key].append(median_seconds(fn, 1, device))
    median = {key: statistics.median(values) for key, values in times.items()}
    return CostCurve(
        model=_model_name(target), device=str(device), dtype=str(draft.fc.weight.dtype),
        threads=torch.get_num_threads(), context=context,
        greedy_seconds=median[("greedy", 1)], catch_up_seconds=median[("catch_up", 2)],
        verify_seconds=_interpolate({n: median[("verify", n)] for n in sizes}, max_tokens),
        level_seconds=[median[("level", w)] for w in range(1, max_width + 1)])


def _model_name(target) -> str:
    """The target's slug; a model built from a config (no name) goes by its model type."""
    name = getattr(target, "name_or_path", "")
    return slug(name) if name else f"unnamed-{target.config.model_type}"


def _cache_key(target, draft, context: int, max_tokens: int, max_width: int) -> dict:
    """What the curve depends on: model (its config), device, dtype, threads, draft shape,
    and the linear routes the target and draft run, if any (``actwave.decoding.linear_routes``;
    stock curves keep the key they had before routes existed)."""
    config_digest = hashlib.sha256(target.config.to_json_string().encode()).hexdigest()[:16]
    key = {"model": _model_name(target), "target_config": config_digest,
           "device": str(draft.fc.weight.device), "dtype": str(draft.fc.weight.dtype),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "draft_layers": len(draft.layer_ids), "draft_vocab": draft.config.draft_vocab_size,
           "context": context, "max_tokens": max_tokens, "max_width": max_width}
    tables = {"target": linear_routes.active(target), "draft": linear_routes.active(draft)}
    if any(tables.values()):
        key["linear_routes"] = {role: table.routes if table else "stock"
                                for role, table in tables.items()}
    return key


def load_or_measure(target, draft, context: int = 256, max_tokens: int = 64,
                    max_width: int = 8, repeats: int = 5) -> CostCurve:
    """The cached ``CostCurve`` of this (model, device, dtype, threads, draft shape), else
    measured now (tens of seconds on a CPU) and cached."""
    key = _cache_key(target, draft, context, max_tokens, max_width)
    path = artifact_dir("costmodel", key, name=key["model"]) / "curve.json"
    if path.exists():
        return CostCurve(**json.loads(path.read_text())["curve"])
    curve = measure_costs(target, draft, context, max_tokens, max_width, repeats)
    atomic_write_json(path, {"key": key, "curve": asdict(curve)})
    return curve


def _curves(target, draft, costs: CostCurve | None) -> tuple:
    costs = costs or load_or_measure(target, draft)
    return (costs.verify_seconds, costs.level_seconds, costs.catch_up_seconds,
            costs.greedy_seconds)


def _reach(acceptance) -> torch.Tensor:
    if acceptance is None:
        raise ValueError("auto_shape needs acceptance: the draft's per-depth reach "
                         "probabilities on held-out text (a list, or {top_k: list}), e.g. "
                         "from actwave.decoding.acceptance")
    return rank_acceptance(acceptance)


def auto_shape(target, draft, acceptance, costs: CostCurve | None = None) -> TreeShape:
    """The tree with the most expected tokens per second for this draft on this machine.

    acceptance: per-depth reach probabilities of the draft on held-out text — a list
    (top-1 chain) or {top_k: list} (see ``actwave.decoding.tree.rank_acceptance``); costs: a
    ``CostCurve``, else ``load_or_measure``.
    """
    p = _reach(acceptance)
    curves = _curves(target, draft, costs)
    return choose_shape(p, *curves, max_depth=p.shape[0], max_top_k=len(curves[1]))


def predict(target, draft, acceptance, shape: TreeShape,
            costs: CostCurve | None = None) -> TreeShape:
    """``shape`` with what the cost model expects of it (tokens and seconds per round,
    predicted speedup) for this draft's held-out ``acceptance`` on this machine."""
    return score_shape(_reach(acceptance), shape.depth, shape.top_k, shape.total_tokens,
                       *_curves(target, draft, costs))


def auto_lookup(target, draft, shape: TreeShape, texts: list[tuple[torch.Tensor, int]],
                costs: CostCurve | None = None, candidates=LOOKUP_TOKENS) -> TreeShape:
    """``shape`` (scored by ``auto_shape``) with the lookup length among ``candidates`` or 0
    (no lookup rounds) that the cost model expects to be fastest on the greedy ``texts``
    (``greedy_texts`` of held-out prompts), every option predicted by the same decoding walk
    over those texts (``actwave.decoding.lookup.score_walk``; the draft's per-root acceptance
    with the shape's depth and top-k: exact for chains and one-level trees, optimistic for
    deeper EAGLE-2 trees, which keep only some of the top-k paths)."""
    verify_seconds, _, _, greedy_seconds = _curves(target, draft, costs)
    walk_texts = [(text.tolist(), start, accepted.tolist()) for (text, start), accepted in
                  zip(texts, held_out_roots(target, draft, texts, shape.depth, shape.top_k))]
    best = score_walk(shape, walk_texts, 0, verify_seconds, greedy_seconds)
    for length in candidates:
        if 0 < length < len(verify_seconds):
            scored = score_walk(shape, walk_texts, length, verify_seconds, greedy_seconds)
            if scored.predicted_speedup > best.predicted_speedup:
                best = scored
    return best


def held_out_prompts(tokenizer, n: int, benchmarks=("sharegpt",), skip: int = 0,
                     max_tokens: int = 384) -> list[torch.Tensor]:
    """(1, T) ids of ``n`` held-out first turns of at most ``max_tokens`` tokens, shared as
    evenly as the benchmarks allow among ``benchmarks`` (``evaluate.BENCHMARKS``; ShareGPT:
    its eval split), each taken after the first ``skip`` prompts of its benchmark — those an
    evaluation of ``skip`` prompts per benchmark decodes, so a shape is never fitted on the
    text it is timed on."""
    if n < 1 or not benchmarks:
        raise ValueError(f"need n >= 1 prompts from at least one benchmark, got n={n}, "
                         f"benchmarks={tuple(benchmarks)}")
    pools = []
    for benchmark in benchmarks:
        items = benchmark_prompts(benchmark, skip + 4 * n)[skip:]
        ids = [prompt_ids(tokenizer, [{"role": "user", "content": item["turns"][0]}])
               for item in items]
        pools.append([torch.tensor([x]) for x in ids if len(x) <= max_tokens])
    chosen = [pool[i] for i in range(max(map(len, pools))) for pool in pools if i < len(pool)][:n]
    if not chosen:
        raise ValueError(f"no held-out prompts of <= {max_tokens} tokens in {tuple(benchmarks)} "
                         f"after the first {skip} of each")
    return chosen


@torch.no_grad()
def greedy_texts(target, prompts: list[torch.Tensor], max_new_tokens: int = 64,
                 eos_token_ids=()) -> list[tuple[torch.Tensor, int]]:
    """[(prompt + the target's greedy reply (L,), index of the reply's first token)]."""
    texts = []
    for ids in prompts:
        reply = greedy_generate(target, ids, max_new_tokens, eos_token_ids).tokens
        texts.append((torch.cat([ids[0], torch.tensor(reply, device=ids.device)]), ids.shape[1]))
    return texts


@torch.no_grad()
def held_out_acceptance(target, draft, texts: list[tuple[torch.Tensor, int]], depth: int = 8,
                        top_ks=(1, 2, 4, 8)) -> dict[int, list[float]]:
    """The draft's reach probabilities on greedy replies (``greedy_texts`` of held-out prompts).

    Every reply position is a round root (``actwave.decoding.acceptance``, exact on greedy text);
    -> {top_k: [P(the first d draft tokens are all accepted) for d = 1..depth]}, the
    input of ``auto_shape``.
    """
    reached = {k: torch.zeros(depth) for k in top_ks}
    roots = 0
    for text, reply_start in texts:
        results = text_acceptance(target, draft, text, reply_start, depth, tuple(top_ks))
        for k, result in zip(top_ks, results):
            reached[k] += result.reached.float().cpu()
        roots += results[0].n_roots
    if roots == 0:
        raise ValueError(f"no round roots in {len(texts)} held-out replies: need replies of >= 2 tokens")
    return {k: (values / roots).tolist() for k, values in reached.items()}


@torch.no_grad()
def held_out_roots(target, draft, texts: list[tuple[torch.Tensor, int]], depth: int,
                   top_k: int) -> list[torch.Tensor]:
    """Per greedy text (``greedy_texts``), the tokens a draft round accepts at each root
    (reply start .. L − 2): (R,) leading hits of the draft's top-``top_k`` proposals over
    ``depth`` steps — the per-root input of ``lookup.score_walk``."""
    accepted = []
    for text, reply_start in texts:
        result = text_acceptance(target, draft, text, reply_start, depth, top_k)
        expected_roots = list(range(reply_start, len(text) - 1))
        if result.roots.tolist() != expected_roots:  # a root the walk needs is missing
            raise ValueError(f"roots {result.roots.tolist()} are not the reply's "
                             f"{reply_start}..{len(text) - 2}")
        accepted.append(result.accepted)
    return accepted
