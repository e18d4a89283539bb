"""Speculative decoding as a user would compare it: every row measured side by side in one run.

SmolLM2 (default), float32, T=0, on the first turns of MT-bench and HumanEval
(``--n-prompts`` each): our plain greedy, HF ``generate``, HF prompt-lookup decoding, and
our EAGLE-3 speculative decoding with the fixed tree (``--depth/--top-k/--total-tokens``)
and with ``tree="auto"`` — the shape ``actwave.decoding.costmodel`` picks from this machine's
measured cost curve (cached) and the draft's acceptance on held-out ShareGPT replies.
Per row: tokens/s, speedup vs our greedy (95% bootstrap CI over prompts), τ, speedup ÷ τ
(the share of τ that survives the round's cost) and the exact-match rate vs our greedy.
The auto row is a second pass with its own greedy reference, so its speedup is measured
side by side as well.

The draft comes from ``--draft`` (a folder; relative ones under the actwave cache).
Without it a random untrained draft stands in and every row says so (τ ≈ 1).

    .venv/bin/python benchmarks/bench_speculative.py --n-prompts 5 [--draft DIR]
"""
from __future__ import annotations

import argparse
import logging

import pandas as pd
import torch

from actwave.capture import models
from actwave.decoding import costmodel
from actwave.decoding.evaluate import EvalConfig, evaluate, load_drafts
from actwave.eagle3 import Eagle3Draft
from actwave.stats.selection import eagle3_default

DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16"}
COLUMNS = ["label", "tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "tau",
           "speedup_per_tau", "exact_match_rate", "n_prompts"]


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
    parser.add_argument("--acceptance-prompts", type=int, default=4,
                        help="held-out ShareGPT prompts whose greedy replies give the acceptance")
    return parser.parse_args(argv)


def load_draft(target, args) -> tuple[Eagle3Draft, bool]:
    """(draft, trained?): the given draft, or a random one on the EAGLE-3 default layers."""
    if args.draft:
        return load_drafts(target, {"draft": args.draft})["draft"], True
    torch.manual_seed(0)
    layers = eagle3_default(models.num_layers(target))
    return Eagle3Draft.from_target(target, layers, draft_vocab_size=32768).eval(), False


def run(target, tokenizer, draft, label: str, settings: dict, peers: bool, args) -> pd.DataFrame:
    """One evaluate() pass: our greedy (+ peers) and the draft with ``settings``; 'all' rows."""
    config = EvalConfig(model=args.model, benchmarks=tuple(args.benchmarks.split(",")),
                        n_prompts=args.n_prompts, max_turns=1, max_new_tokens=args.max_new_tokens,
                        peers=peers, **settings)
    out = evaluate(target, tokenizer, {label: draft}, config,
                   models.stop_token_ids(tokenizer, args.model))
    summary = out["summary"]
    table = summary[summary.benchmark == "all"].copy()
    table["speedup_per_tau"] = table.speedup / table.tau
    return table[COLUMNS].reset_index(drop=True)


def compare(args) -> tuple[pd.DataFrame, dict, bool]:
    """All rows (fixed-tree pass with peers, then the auto-tree pass) and the auto shape."""
    target, tokenizer = models.load(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    draft, trained = load_draft(target, args)
    eos = models.stop_token_ids(tokenizer, args.model)
    prompts = [p.to(args.device) for p in costmodel.held_out_prompts(tokenizer, args.acceptance_prompts)]
    acceptance = costmodel.held_out_acceptance(
        target, draft, costmodel.greedy_texts(target, prompts, eos_token_ids=eos))
    shape = costmodel.auto_shape(target, draft, acceptance)
    fixed = dict(mode="tree", depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens)
    first = run(target, tokenizer, draft, "spec_fixed", fixed, True, args)
    second = run(target, tokenizer, draft, "spec_auto", shape.settings(), False, args)
    table = pd.concat([first, second[second.label != "greedy"]], ignore_index=True)
    info = {"acceptance": acceptance, "shape": shape, "fixed": fixed, "dtype": args.dtype}
    return table, info, trained


def summary_rows(table: pd.DataFrame, info: dict, trained: bool) -> list[dict]:
    """One run_all.py row per label: its tokens/s relative to our plain greedy."""
    mark = "" if trained else " [RANDOM draft]"
    shape, fixed = info["shape"], info["fixed"]
    shapes = {"spec_fixed": f"tree {fixed['depth']}/{fixed['top_k']}/{fixed['total_tokens']}",
              "spec_auto": f"auto: {shape.mode} {shape.depth}/{shape.top_k}/{shape.total_tokens}, "
                           f"predicted {shape.predicted_speedup:.2f}x"}
    rows = []
    for row in table.itertuples():
        if row.label == "greedy":
            continue
        spec = row.label in shapes
        detail = (f"tau {row.tau:.2f}; speedup/tau {row.speedup_per_tau:.2f}; {shapes[row.label]}; "
                  if spec else "")
        rows.append({"benchmark": "speculative",
                     "measure": f"{row.label} / our greedy tok/s ({DTYPE_LABELS[info.get('dtype', 'float32')]})"
                                + (mark if spec else ""),
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
    print(f"auto tree: {shape.mode} depth {shape.depth}, top-k {shape.top_k}, "
          f"{shape.total_tokens} tokens; expected {shape.expected_tokens:.2f} tokens per round, "
          f"predicted speedup {shape.predicted_speedup:.2f}")
    print(table.to_string(index=False, float_format="%.3f"))
    return summary_rows(table, info, trained)


if __name__ == "__main__":
    main()
