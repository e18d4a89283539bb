"""Speculative decoding as a user would compare it: every row measured side by side in one run.

SmolLM2 (default), float32, T=0, on the first turns of MT-bench and HumanEval
(``--n-prompts`` each): our plain greedy, HF ``generate``, HF prompt-lookup decoding, and
our EAGLE-3 speculative decoding with the fixed tree (``--depth/--top-k/--total-tokens``)
and with the auto shape — the one ``actwave.decoding.costmodel`` picks from this machine's
measured cost curve (cached) and the draft's acceptance on greedy replies to held-out
MT-bench and HumanEval prompts (the ones after the timed ones).
Per row: tokens/s, speedup vs our greedy (95% bootstrap CI over prompts), τ, speedup ÷ τ
(the share of τ that survives the round's cost) and the exact-match rate vs our greedy.
The auto row is a second pass with its own greedy reference, so its speedup is measured
side by side as well.

The draft comes from ``--draft`` (a folder; relative ones under the actwave cache).
Without it a random untrained draft stands in and every row says so (τ ≈ 1).

Linear layers (``--linear-routes``): ``measured`` (default) runs every row — our greedy,
HF's, the drafts — with the GEMM formulation measured fastest per row count on this machine
(``actwave.decoding.linear_routes``), so speculative decoding is compared with the fastest
greedy we have; an extra row gives that greedy against stock ``F.linear`` greedy,
alternating per prompt, outputs compared. ``stock`` leaves every linear as it is.

    .venv/bin/python benchmarks/bench_speculative.py --n-prompts 5 [--draft DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import logging

import pandas as pd
import torch

from actwave.capture import data, models
from actwave.decoding import fastpath, linear_routes
from actwave.decoding.evaluate import EvalConfig, benchmark_prompts, load_drafts
from actwave.decoding.speculative import greedy_generate
from actwave.eagle3 import Eagle3Draft
from actwave.stats.selection import eagle3_default

DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16"}
COLUMNS = ["label", "tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "tau",
           "speedup_per_tau", "lookup_share", "exact_match_rate", "n_prompts"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--benchmarks", default="mtbench,humaneval")
    parser.add_argument("--n-prompts", type=int, default=5, help="per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft", help="trained draft folder (else a RANDOM draft)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="bf16: verification may flip near-ties; the exact-match rate says")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--depth", type=int, default=4, help="fixed tree")
    parser.add_argument("--top-k", type=int, default=4, help="fixed tree")
    parser.add_argument("--total-tokens", type=int, default=16, help="fixed tree")
    parser.add_argument("--linear-routes", default="measured", choices=("measured", "stock"),
                        help="measured: fastest GEMM formulation per row count (cached per machine)")
    parser.add_argument("--acceptance-prompts", type=int, default=16,
                        help="held-out prompts (after the timed ones, in turn from each benchmark) "
                             "whose greedy replies give the acceptance")
    parser.add_argument("--lookup", default="on", choices=("on", "off"),
                        help="on: the auto shape may add prompt-lookup rounds (actwave.decoding.lookup)")
    return parser.parse_args(argv)


def load_draft(target, args) -> tuple[Eagle3Draft, bool]:
    """(draft, trained?): the given draft, or a random one on the EAGLE-3 default layers."""
    if args.draft:
        return load_drafts(target, {"draft": args.draft})["draft"], True
    torch.manual_seed(0)
    layers = eagle3_default(models.num_layers(target))
    return Eagle3Draft.from_target(target, layers, draft_vocab_size=32768).eval(), False


@torch.no_grad()
def route_gain(target, tokenizer, table: linear_routes.RouteTable, args) -> dict:
    """Our greedy with ``table``'s routes vs with stock linears, alternating per prompt on
    the benchmark prompts: tokens/s of each and whether every output is identical."""
    eos = models.stop_token_ids(tokenizer, args.model)
    seconds, tokens, identical = {"stock": 0.0, "routed": 0.0}, 0, True
    for benchmark in args.benchmarks.split(","):
        for item in benchmark_prompts(benchmark, args.n_prompts):
            ids = torch.tensor([data.prompt_ids(tokenizer, [{"role": "user", "content": item["turns"][0]}])],
                               device=args.device)
            outputs = {}
            for label in ("stock", "routed"):
                with linear_routes.use_routes(target, table) if label == "routed" else contextlib.nullcontext():
                    result = greedy_generate(target, ids, args.max_new_tokens, eos)
                seconds[label] += result.timings["decode"]
                outputs[label] = result.tokens
            tokens += len(outputs["stock"]) - 1
            identical &= outputs["stock"] == outputs["routed"]
    return {"stock_tokens_per_s": tokens / seconds["stock"],
            "routed_tokens_per_s": tokens / seconds["routed"], "identical": identical}


def rows_of(comparison: fastpath.Comparison) -> pd.DataFrame:
    """The pooled ("all") rows: greedy and peers from the fixed pass, the draft of each pass
    as ``spec_fixed`` / ``spec_auto``."""
    summary = comparison.summary()
    table = summary[summary.benchmark == "all"].copy()
    spec = table.label == "draft"
    table.loc[spec, "label"] = "spec_" + table.loc[spec, "pass"]
    table = table[spec | (table["pass"] == "fixed")]
    return table[COLUMNS].reset_index(drop=True)


def per_benchmark(comparison: fastpath.Comparison, label: str = "draft") -> dict[str, str]:
    """{spec_fixed|spec_auto: "mtbench 1.21x tau 1.52, humaneval …"}: the speedup and τ of the
    draft ``label`` per benchmark in each pass, so a pooled number that misses its prediction
    shows where."""
    summary = comparison.summary()
    rows = summary[(summary.label == label) & (summary.benchmark != "all")]
    return {f"spec_{name}": ", ".join(f"{row.benchmark} {row.speedup:.2f}x tau {row.tau:.2f}"
                                      for row in group.itertuples())
            for name, group in rows.groupby("pass", sort=False)}


def compare(args) -> tuple[pd.DataFrame, dict, bool]:
    """Every row through ``fastpath.compare`` (the notebooks' path): the fixed tree with the
    HF peers, then the auto shape, under the measured linear routes unless ``stock``."""
    target, tokenizer = models.load(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    draft, trained = load_draft(target, args)
    config = EvalConfig(model=args.model, benchmarks=tuple(args.benchmarks.split(",")),
                        n_prompts=args.n_prompts, max_turns=1, max_new_tokens=args.max_new_tokens,
                        peers=True, mode="tree", depth=args.depth, top_k=args.top_k,
                        total_tokens=args.total_tokens)
    comparison = fastpath.compare(target, tokenizer, {"draft": draft}, config,
                                  models.stop_token_ids(tokenizer, args.model),
                                  routes=args.linear_routes,
                                  acceptance_prompts=args.acceptance_prompts,
                                  lookup=args.lookup == "on")
    target_table = comparison.tables.get(models.slug(args.model))
    gain = route_gain(target, tokenizer, target_table, args) if target_table else None
    fixed = dict(mode="tree", depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens)
    info = {"acceptance": comparison.reach, "shape": comparison.auto, "fixed": fixed,
            "fixed_shape": comparison.shapes["fixed"],
            "dtype": args.dtype, "route_gain": gain, "per_benchmark": per_benchmark(comparison),
            "tables": {"target": target_table} if target_table else {}}
    return rows_of(comparison), info, trained


def _prediction(shape) -> str:
    """The cost model's expectation of a shape: its speedup and the τ behind it."""
    if shape is None:
        return ""
    return f", predicted {shape.predicted_speedup:.2f}x at tau {shape.expected_tokens:.2f}"


def summary_rows(table: pd.DataFrame, info: dict, trained: bool) -> list[dict]:
    """One run_all.py row per label: its tokens/s relative to our plain greedy."""
    mark = "" if trained else " [RANDOM draft]"
    shape, fixed = info["shape"], info["fixed"]
    shapes = {"spec_fixed": f"tree {fixed['depth']}/{fixed['top_k']}/{fixed['total_tokens']}"
                            + _prediction(info.get("fixed_shape")),
              "spec_auto": f"auto: {shape.label()}" + _prediction(shape)}
    routed = ", routed linears" if info.get("tables") else ""
    gain = info.get("route_gain")
    rows = [] if not gain else [{
        "benchmark": "speculative", "ratio": gain["routed_tokens_per_s"] / gain["stock_tokens_per_s"],
        "measure": f"greedy routed / stock linears tok/s ({DTYPE_LABELS[info.get('dtype', 'float32')]})",
        "target": "-", "detail": f"{gain['routed_tokens_per_s']:.1f} vs {gain['stock_tokens_per_s']:.1f} "
                                 f"tok/s; outputs {'identical' if gain['identical'] else 'DIFFER'}"}]
    for row in table.itertuples():
        if row.label == "greedy":
            continue
        spec = row.label in shapes
        split = info.get("per_benchmark", {}).get(row.label)
        lookup = f"lookup rounds {row.lookup_share:.0%}; " if row.lookup_share > 0 else ""
        detail = (f"tau {row.tau:.2f}; speedup/tau {row.speedup_per_tau:.2f}; {shapes[row.label]}; "
                  + lookup + (f"{split}; " if split else "") if spec else "")
        rows.append({"benchmark": "speculative",
                     "measure": f"{row.label} / our greedy tok/s ({DTYPE_LABELS[info.get('dtype', 'float32')]}"
                                f"{routed})" + (mark if spec else ""),
                     "ratio": row.speedup, "target": ">= 1 (issue), 1.5 aim" if spec else "-",
                     "detail": detail + f"exact {row.exact_match_rate:.0%}; {row.n_prompts} prompts"})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the comparison, print its table; return its summary rows for run_all.py."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    pd.set_option("display.width", 200)
    table, info, trained = compare(args)
    shape = info["shape"]
    print(f"== {args.model} {args.dtype} on {args.device}, {args.benchmarks} first turns, "
          f"{args.n_prompts} prompts each, {args.max_new_tokens} new tokens, T=0; draft: "
          f"{args.draft or 'RANDOM untrained'}")
    print("held-out reach P(first d accepted), top-1:",
          " ".join(f"{x:.3f}" for x in info["acceptance"][1]))
    print(f"auto shape: {shape.label()} (mode depth/top-k/tree tokens); expected "
          f"{shape.expected_tokens:.2f} tokens per round, predicted speedup "
          f"{shape.predicted_speedup:.2f}")
    if info["route_gain"]:
        gain = info["route_gain"]
        print(f"linear routes: target {info['tables']['target'].routes}; greedy "
              f"{gain['routed_tokens_per_s']:.2f} tok/s routed vs {gain['stock_tokens_per_s']:.2f} stock "
              f"(outputs {'identical' if gain['identical'] else 'DIFFER'}); every row below runs routed")
    print(table.to_string(index=False, float_format="%.3f"))
    for label, split in info["per_benchmark"].items():
        print(f"{label} per benchmark: {split}")
    return summary_rows(table, info, trained)


if __name__ == "__main__":
    main()
