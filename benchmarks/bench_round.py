"""Where a speculative round's time goes, per section, on the real target (fp32, batch 1).

    .venv/bin/python benchmarks/bench_round.py [--model smollm2-135m] [--draft DIR]
        [--n-prompts 2] [--max-new-tokens 64] [--context 256] [--repeats 5]
        [--linear-routes measured|stock]

Everything runs under the measured linear routes (``actwave.decoding.linear_routes``: the
fastest GEMM formulation per row count on this machine) unless ``--linear-routes stock``.

1. Cost curve (``actwave.decoding.costmodel.measure_costs``, sizes interleaved, medians): one greedy
   step; verification over n = 1..64 tree tokens (forward + acceptance + cache
   bookkeeping) beside a bare HF forward over the same n tokens (the floor) and beside
   the same verification with HF's repeat_kv attention (the route before packed GQA);
   one draft tree level per width; the draft's catch-up pass.
2. Real rounds: ``speculative.generate`` (chain depth 4; trees 1/2/3 — the auto shape on
   the 2-core Xeon — 4/4/16 and 6/8/32) on
   MT-bench first turns; the mean seconds per round of each section (catch-up, tree
   drafting, verification forward, acceptance + bookkeeping), in greedy steps measured
   in the same run by ``greedy_generate``.

Without ``--draft`` a random untrained draft stands in (marked RANDOM): τ ≈ 1, so each
round's cost is pure overhead — exactly what this table is for.
"""
from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import torch
from transformers import DynamicCache

from actwave.capture import data, models
from actwave.decoding import costmodel, linear_routes, speculative
from actwave.decoding.evaluate import benchmark_prompts, load_drafts
from actwave.decoding.tree import TreeShape
from actwave.eagle3 import Eagle3Draft
from actwave.stats.selection import eagle3_default

SETTINGS = {"chain d4": TreeShape("chain", depth=4),
            "tree 1/2/3": TreeShape("tree", depth=1, top_k=2, total_tokens=3),  # auto's pick here
            "tree 4/4/16": TreeShape("tree", depth=4, top_k=4, total_tokens=16),
            "tree 6/8/32": TreeShape("tree", depth=6, top_k=8, total_tokens=32)}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--draft", help="trained draft folder (relative: under the actwave cache)")
    parser.add_argument("--n-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--linear-routes", default="measured", choices=("measured", "stock"),
                        help="measured: fastest GEMM formulation per row count "
                             "(actwave.decoding.linear_routes; cached per machine)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def load_draft(target, folder):
    """(draft, label): the trained draft, or a random one on the default layers."""
    if folder:
        return load_drafts(target, {"draft": folder})["draft"], f"trained draft {folder}"
    torch.manual_seed(0)
    layers = eagle3_default(models.num_layers(target))
    draft = Eagle3Draft.from_target(target, layers, draft_vocab_size=32768).eval()
    return draft, f"RANDOM untrained draft on layers {layers}"


@torch.no_grad()
def floor_and_old_route(target, draft, context: int, sizes, repeats: int) -> pd.DataFrame:
    """Per n, interleaved in one loop, medians (s): our verification (forward + acceptance +
    bookkeeping), the same forward with HF's own SDPA (repeat_kv) instead of packed GQA,
    and a bare HF forward (causal, no hooks, full logits: the floor)."""
    routes = ("ours", "repeat_kv", "bare")
    device = draft.fc.weight.device
    ids = torch.randint(0, 100, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    bare_cache, cache = DynamicCache(config=target.config), DynamicCache()
    target(input_ids=ids, cache=bare_cache, use_cache=True, logits_to_keep=1)
    target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    implementation = target.config._attn_implementation
    times = {(route, n): [] for n in sizes for route in routes}

    def bare(n):
        target(input_ids=ids[:, :n], cache=bare_cache, use_cache=True)
        costmodel.trim_cache(bare_cache, context)

    def repeat_kv(n):
        tree = costmodel.chain_tree(n, device)
        with speculative.attention_implementation(target, implementation):
            speculative.forward_with_states(
                target, draft.layer_ids, tree.tokens[None], cache=cache,
                position_ids=(context + tree.depths)[None],
                attention_mask=speculative.target_tree_mask(tree, context, target.config,
                                                            torch.float32))
        costmodel.trim_cache(cache, context)

    def ours(n):
        tree = costmodel.chain_tree(n, device)
        logits, states = speculative.verify_forward(target, draft.layer_ids, tree, cache, context)
        speculative.accept_round(tree, logits, states, cache, context)
        costmodel.trim_cache(cache, context)

    run = {"ours": ours, "repeat_kv": repeat_kv, "bare": bare}
    for n in sizes:  # warm-up
        for route in routes:
            run[route](n)
    for _ in range(repeats):
        for (route, n), values in times.items():
            values.append(costmodel.median_seconds(lambda: run[route](n), 1, device))
    return pd.DataFrame([{"n": n, **{route: statistics.median(times[(route, n)])
                                     for route in routes}} for n in sizes])


def cost_table(curve, floor: pd.DataFrame) -> pd.DataFrame:
    step = curve.greedy_seconds
    rows = [{"section": "greedy step", "ms": 1e3 * step, "greedy steps": 1.0}]
    rows.append({"section": "draft catch-up (2 rows)", "ms": 1e3 * curve.catch_up_seconds,
                 "greedy steps": curve.catch_up_seconds / step})
    for width, seconds in enumerate(curve.level_seconds, 1):
        if width in (1, 2, 4, 8):
            rows.append({"section": f"draft tree level, width {width}", "ms": 1e3 * seconds,
                         "greedy steps": seconds / step})
    for row in floor.itertuples():  # one interleaved loop: the three routes share the load
        rows.append({"section": f"verify n={row.n}: ours (ms) / HF repeat_kv / bare, ratios to ours",
                     "ms": 1e3 * row.ours, "greedy steps": curve.verify_seconds[row.n - 1] / step,
                     "repeat_kv / ours": row.repeat_kv / row.ours, "bare / ours": row.bare / row.ours})
    return pd.DataFrame(rows)


def round_table(target, draft, tokenizer, args) -> pd.DataFrame:
    """Mean seconds per round and section of real generations, in greedy steps."""
    eos = models.stop_token_ids(tokenizer, args.model)
    prompts = [torch.tensor([data.prompt_ids(tokenizer, [{"role": "user", "content": p["turns"][0]}])],
                            device=args.device) for p in benchmark_prompts("mtbench", args.n_prompts)]
    speculative.generate(target, draft, prompts[0], 4)  # warm-up
    greedy_seconds = greedy_tokens = 0
    totals = {label: {s: 0.0 for s in speculative.SECTIONS[1:]} | {"rounds": 0, "tokens": 0}
              for label in SETTINGS}
    for ids in prompts:
        reference = speculative.greedy_generate(target, ids, args.max_new_tokens, eos)
        greedy_seconds += reference.timings["decode"]
        greedy_tokens += len(reference.tokens) - 1
        for label, shape in SETTINGS.items():
            result = speculative.generate(target, draft, ids, args.max_new_tokens,
                                          shape=shape, eos_token_ids=eos)
            assert result.tokens == reference.tokens, f"{label}: output differs from greedy"
            for section in speculative.SECTIONS[1:]:
                totals[label][section] += result.timings[section]
            totals[label]["rounds"] += sum(result.accept_counts)
            totals[label]["tokens"] += len(result.tokens) - 1
    step = greedy_seconds / greedy_tokens
    rows = []
    for label, total in totals.items():
        per_round = {s: total[s] / total["rounds"] / step for s in speculative.SECTIONS[1:]}
        round_steps = sum(per_round.values())
        tau = total["tokens"] / total["rounds"]
        rows.append({"setting": label, **per_round, "round": round_steps, "tau": tau,
                     "speedup": tau / round_steps})
    return pd.DataFrame(rows), step


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    pd.set_option("display.width", 200)
    target, tokenizer = models.load(args.model, dtype=torch.float32, device=args.device)
    draft, label = load_draft(target, args.draft)
    modules = {} if args.linear_routes == "stock" else {models.slug(args.model): target, "draft": draft}
    with linear_routes.routed(modules) as tables:
        for name, table in tables.items():
            print(route_line(name, table))
        return measure(target, tokenizer, draft, label, args)


def route_line(name: str, table: linear_routes.RouteTable) -> str:
    """One sweep over the module's linears per route, ms, at a few row counts; * = chosen."""
    cells = []
    for i, rows in enumerate(table.rows):
        if rows in (1, 2, 4, 8, 16, 64):
            times = "/".join(f"{1e3 * table.seconds[route][i]:.0f}"
                             + ("*" if route == table.routes[i] else "") for route in table.seconds)
            cells.append(f"{rows}: {times}")
    return (f"linear routes, {name}: one sweep over its linears (ms), "
            f"{' / '.join(table.seconds)} by row count (* = chosen): " + ", ".join(cells))


def measure(target, tokenizer, draft, label: str, args) -> list[dict]:
    routes = "measured linear routes" if args.linear_routes == "measured" else "stock linears"
    print(f"== {args.model} float32 on {args.device}, threads {torch.get_num_threads()}, {routes}, "
          f"{label}")
    curve = costmodel.measure_costs(target, draft, args.context, repeats=args.repeats)
    floor = floor_and_old_route(target, draft, args.context, [1, 4, 8, 16, 32, 64], args.repeats)
    print(f"\n-- cost curve on a {args.context}-token cache (medians of {args.repeats})")
    print(cost_table(curve, floor).to_string(index=False, float_format="%.2f"))
    rounds, step = round_table(target, draft, tokenizer, args)
    print(f"\n-- real rounds, {args.n_prompts} MT-bench prompts x {args.max_new_tokens} tokens: "
          f"seconds per round in greedy steps ({1e3 * step:.1f} ms/step in this run); "
          "every output equals greedy")
    print(rounds.to_string(index=False, float_format="%.2f"))
    chain = rounds.iloc[0]
    return [{"benchmark": "round", "measure": f"chain-4 round / greedy step ({routes})" + (
                "" if args.draft else " [RANDOM draft]"),
             "ratio": chain["round"], "target": "floor ~1.2-1.3",
             "detail": f"verify {chain.verify:.2f}, tree {chain.tree:.2f}, catch-up "
                       f"{chain.catch_up:.2f}, accept {chain.accept:.2f}; greedy step "
                       f"{1e3 * step:.1f} ms"}]


if __name__ == "__main__":
    main()
