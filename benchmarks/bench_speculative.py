"""Speculative decoding on CPU, all rows measured side by side in one run.

SmolLM2 (default) at T=0 on MT-bench first turns: tokens/s of HF ``generate``, our plain
greedy, HF prompt-lookup decoding, an EAGLE-3 draft on the default layers
``(2, N//2, N-3)`` and the best selected draft; τ, speedup vs our greedy and the exact-
match rate vs our greedy, in float32 and again in bfloat16 (batched verification can flip
near-ties in bf16: its match rate is reported, not hidden).

Drafts come from notebook 06 (``--default-draft`` / ``--best-draft``: folders, relative
ones under the actwave cache). Without them, random untrained drafts stand in and the
output says so (τ ≈ 1 then: the timing rows still show the verification overhead).

    .venv/bin/python benchmarks/bench_speculative.py --n-prompts 5
"""
from __future__ import annotations

import argparse
import logging

import pandas as pd
import torch

from actwave import models
from actwave.eagle3 import Eagle3Draft
from actwave.evaluate import EvalConfig, evaluate, load_drafts
from actwave.selection import eagle3_default

COLUMNS = ["method", "tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "tau",
           "exact_match_rate", "match_prefix_frac", "n_prompts"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--n-prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--default-draft", help="draft dir for the EAGLE-3 default layers")
    parser.add_argument("--best-draft", help="draft dir for the best selected layer set")
    parser.add_argument("--best-layers", default="5,6,7",
                        help="layers of the random stand-in 'best' draft when --best-draft is absent")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mode", default="tree", choices=["tree", "chain"])
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--total-tokens", type=int, default=32)
    parser.add_argument("--bf16-prompts", type=int, default=3,
                        help="prompts for the bf16 match-rate pass (0 to skip)")
    return parser.parse_args(argv)


def drafts_for(target, args) -> tuple[dict, list[str]]:
    """Trained drafts from the given dirs, random stand-ins otherwise (with a note)."""
    default_layers = eagle3_default(models.num_layers(target))
    specs = {"eagle3_default": (args.default_draft, default_layers),
             "best_selected": (args.best_draft, tuple(int(x) for x in args.best_layers.split(",")))}
    drafts, notes = {}, []
    for label, (directory, layers) in specs.items():
        if directory:
            drafts.update(load_drafts(target, {label: directory}))
        else:
            torch.manual_seed(0)
            drafts[label] = Eagle3Draft.from_target(target, layers, draft_vocab_size=32768).eval()
            notes.append(f"{label}: RANDOM untrained draft on layers {layers} (no trained draft given)")
    return drafts, notes


def run(dtype: torch.dtype, n_prompts: int, peers: bool, args) -> pd.DataFrame:
    target, tokenizer = models.load(args.model, dtype=dtype, device=args.device)
    drafts, notes = drafts_for(target, args)
    config = EvalConfig(model=args.model, dtype=str(dtype).removeprefix("torch."),
                        benchmarks=("mtbench",), n_prompts=n_prompts, max_turns=1,
                        max_new_tokens=args.max_new_tokens, mode=args.mode, depth=args.depth,
                        top_k=args.top_k, total_tokens=args.total_tokens, peers=peers)
    out = evaluate(target, tokenizer, drafts, config, models.stop_token_ids(tokenizer, args.model))
    for note in notes:
        print("NOTE:", note)
    summary = out["summary"]
    return summary[summary.benchmark == "mtbench"][COLUMNS].reset_index(drop=True)


def summary_rows(table: pd.DataFrame, args) -> list[dict]:
    """One run_all.py row per method: its tokens/s relative to our plain greedy."""
    untrained = {"eagle3_default": not args.default_draft, "best_selected": not args.best_draft}
    return [{"benchmark": "speculative", "measure": f"{row.method} / our greedy tok/s (fp32)"
             + (" [RANDOM draft]" if untrained.get(row.method) else ""),
             "ratio": row.speedup, "target": "-" if pd.isna(row.tau) else ">= 2 (paper, GPU)",
             "detail": ("" if pd.isna(row.tau) else f"tau {row.tau:.2f}; ")
                       + f"exact {row.exact_match_rate:.0%}; {row.n_prompts} prompts"}
            for row in table.itertuples() if row.method != "greedy"]


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, print its tables; return its summary rows for run_all.py."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    pd.set_option("display.width", 200)
    print(f"== {args.model} float32 on {args.device}, MT-bench first turns, {args.n_prompts} prompts, "
          f"{args.max_new_tokens} new tokens, T=0, {args.mode} "
          f"(depth {args.depth}, top-k {args.top_k}, {args.total_tokens} tokens)")
    table = run(torch.float32, args.n_prompts, True, args)
    print(table.to_string(index=False, float_format="%.3f"))
    if args.bf16_prompts:
        print(f"== bfloat16 match rate of speculative vs our bf16 greedy ({args.bf16_prompts} prompts)")
        print(run(torch.bfloat16, args.bf16_prompts, False, args).to_string(index=False, float_format="%.3f"))
    return summary_rows(table, args)


if __name__ == "__main__":
    main()
