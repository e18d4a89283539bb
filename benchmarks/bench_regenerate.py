"""Tokens/s of batched greedy regeneration, SmolLM2-135M bf16: batch 16 vs batch 1, one run.

    .venv/bin/python benchmarks/bench_regenerate.py [--dtype bfloat16] [--device cpu]
        [--n-batched 16] [--n-single 4] [--max-new-tokens 64] [--max-prompt-len 256]
        [--batch-sizes 16,32]

Batch 1 runs before and after the batched run so drift in machine speed shows.
``--batch-sizes`` also times the same ``--n-batched`` prompts split into batches of each
size (a pool's ``batch_size``, ``profiles/data/pools.yaml``; bf16 batches change the greedy
text slightly, so the size is part of a pool's key).
"""
import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from actwave.capture import data, models, regenerate as regen

MODEL = "smollm2-135m"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n-batched", type=int, default=16)
    parser.add_argument("--n-single", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--batch-sizes", default="",
                        help="comma-separated batch sizes to time on the same prompts")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, print its lines; return its summary rows for run_all.py."""
    args = parse_args(argv)
    model, tokenizer = models.load(MODEL, dtype=getattr(torch, args.dtype), device=args.device)
    config = regen.RegenConfig(model=MODEL, n_conversations=args.n_batched,
                               max_prompt_len=args.max_prompt_len,
                               max_new_tokens=args.max_new_tokens)
    rows, _, _ = regen.select_conversations(config, tokenizer)
    prompts = [data.prompt_ids(tokenizer, r["turns"][0]) for r in rows]
    stop_ids, pad_id = models.stop_token_ids(tokenizer, MODEL), tokenizer.pad_token_id

    def tokens_per_second(batch_size: int, subset: list) -> tuple[float, int, float]:
        tic = time.perf_counter()
        replies = regen.generate_sorted(model, subset, batch_size, args.max_new_tokens,
                                        stop_ids, pad_id)
        seconds = time.perf_counter() - tic
        n_new = sum(len(r) for r in replies)
        return n_new / seconds, n_new, seconds

    regen.generate_sorted(model, prompts[:2], 2, 4, stop_ids, pad_id)  # warm-up
    rates = {}
    for label, batch_size, subset in [("batch 1", 1, prompts[: args.n_single]),
                                      (f"batch {args.n_batched}", args.n_batched, prompts),
                                      ("batch 1 (again)", 1, prompts[: args.n_single])]:
        rate, n_new, seconds = tokens_per_second(batch_size, subset)
        rates[label] = rate
        print(f"{label:16s} prompts={len(subset):3d} new_tokens={n_new:5d} "
              f"seconds={seconds:7.1f} tok/s={rate:7.1f}", flush=True)
    for size in [int(x) for x in args.batch_sizes.split(",") if x]:
        rate, n_new, seconds = tokens_per_second(size, prompts)
        print(f"batch {size:<10d} prompts={len(prompts):3d} new_tokens={n_new:5d} "
              f"seconds={seconds:7.1f} tok/s={rate:7.1f} "
              f"({rate / rates[f'batch {args.n_batched}']:.2f}x batch {args.n_batched})", flush=True)
    print(f"prompt lengths: {sorted(len(p) for p in prompts)}")
    single = (rates["batch 1"] + rates["batch 1 (again)"]) / 2
    batched = rates[f"batch {args.n_batched}"]
    print(f"ratio batch {args.n_batched} / batch 1 tokens/s: {batched / single:.2f}")
    return [{"benchmark": "regenerate", "measure": f"batch {args.n_batched} / batch 1 tok/s "
             f"({args.dtype})", "ratio": batched / single, "target": "> 1",
             "detail": f"{batched:.0f} vs {single:.0f} tok/s"}]


if __name__ == "__main__":
    main()
